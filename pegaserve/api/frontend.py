"""Running requests: one engine request per prompt (its `n` choices share the prefill), each
choice's stop strings applied on the way out, the ledger told what each choice's client was given.
Streaming and non-streaming share this path."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass, replace

from pegaserve.api.beam import BeamPlan, beam_search, final_output, num_alternatives
from pegaserve.api.choice import ChoiceDelta, ChoiceStream
from pegaserve.api.errors import ApiError
from pegaserve.api.ledger_view import ledger_view
from pegaserve.api.model_info import ModelInfo
from pegaserve.api.observer import RequestObserver
from pegaserve.api.responses.background import BackgroundResponses
from pegaserve.api.responses.store import MemoryResponseStore, ResponseStore
from pegaserve.api.services import EngineClient, LedgerClient
from pegaserve.api.stored_chats import StoredChat, StoredChats
from pegaserve.api.validation import PromptPlan
from pegaserve.api.wire import ChoiceResult, Usage, Wire
from pegaserve.config import Limits
from pegaserve.ledger import Arrived, Finished, LedgerEvent, TokensCommitted
from pegaserve.messages import (
    EngineOverloaded,
    EngineRequest,
    RequestRejected,
    SampledToken,
    SamplingParams,
    StepOutput,
)
from pegaserve.stop import Abort, Error, StopCause, StopPolicy, String
from pegaserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)
FAILED = "the server failed the request"  # what a client is told; the detail goes to the log


@dataclass(frozen=True)
class Job:
    """One HTTP request: its id, its prompts' plans, `n` choices per prompt, and their format.
    Choice j of prompt p is choice `p * n + j` on the wire, as OpenAI numbers them."""

    response_id: str
    client_request_id: str | None
    prompts: tuple[PromptPlan, ...]
    n: int
    wire: Wire
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    beam: BeamPlan | None = None  # use_beam_search: the choices are the best beams (pegaserve/api/beam.py)
    stored: StoredChat | None = None  # chat's `store`: the whole completion is kept (pegaserve/api/stored_chats.py)
    owner: str | None = None  # whose key asked (api/guards.py `owner_of`): what it stores is theirs alone

    def engine_request(self, p: int) -> EngineRequest:
        """Prompt p's engine request; its id is unique per HTTP request and per prompt."""
        plan = self.prompts[p]
        request_id = self.response_id if len(self.prompts) == 1 else f"{self.response_id}-{p}"
        return EngineRequest(request_id, plan.prompt_token_ids, plan.sampling, plan.policy, n=self.n,
                             num_prompt_logprobs=plan.num_prompt_logprobs, cache_salt=self.cache_salt(plan),
                             priority=plan.priority, prediction=plan.prediction)

    def cache_salt(self, plan: PromptPlan) -> str | None:
        """The prompt's cache salt: with keys, the key's owner salts every prompt (the client's salt
        after it), so `cached_tokens` never tells one tenant what another's prompts held."""
        if self.owner is None:
            return plan.cache_salt
        return self.owner if plan.cache_salt is None else f"{self.owner}/{plan.cache_salt}"

    def results(self) -> list[ChoiceResult]:
        return [ChoiceResult(p * self.n + j, plan.prompt_token_ids, plan.echo_text)
                for p, plan in enumerate(self.prompts) for j in range(self.n)]

    def usage(self, results: list[ChoiceResult]) -> Usage:
        """The prompts once each (their choices share them), every choice's tokens, and the prompt
        tokens the prefix cache held (a prompt's choices share its lookup: its first choice's figure)."""
        cached = [results[p * self.n].num_cached_tokens for p in range(len(self.prompts))]
        predicted = None
        if any(p.prediction for p in self.prompts):
            predicted = tuple(sum(r.prediction_tokens[k] for r in results) for k in (0, 1))
        return Usage(sum(len(p.prompt_token_ids) for p in self.prompts), sum(len(r.tokens) for r in results),
                     None if None in cached else sum(cached), predicted)


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Frontend:
    """Runs a request's choices on an engine client, applies stop strings, tells the ledger."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model: ModelInfo, ledger: LedgerClient,
                 limits: Limits = Limits(), observer: RequestObserver | None = None,
                 responses: ResponseStore | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.ledger = ledger
        self.limits = limits
        self.observer = observer or RequestObserver()
        self.responses = responses or MemoryResponseStore()  # the Responses API's stored responses
        self.background = BackgroundResponses(self.responses)
        self.chats = StoredChats(self.responses)

    async def complete(self, job: Job) -> dict:
        """Non-streaming: run every choice to its end, then one body."""
        results = job.results()
        async with aclosing(self._deltas(job)) as deltas:
            async for index, delta in deltas:
                results[index].add(delta)
        if any(isinstance(r.finish, Error) for r in results):
            raise ApiError(FAILED, status=500)
        return await self._kept(job, results)

    async def stream(self, job: Job) -> AsyncIterator[dict]:
        """Streaming: chunks as they come, one finishing chunk per choice, then usage."""
        results = job.results()
        async with aclosing(self._deltas(job)) as deltas:
            async for index, delta in deltas:
                result = results[index]
                result.add(delta)
                if isinstance(delta.finish, Error):
                    yield ApiError(FAILED, status=500).body()
                    return
                # vLLM's continuous usage: the choice's prompt and its tokens so far
                usage = Usage(len(result.prompt_token_ids), len(result.tokens)) if job.continuous_usage else None
                if result.num_deltas == 1 and job.wire.chat:  # after admission: refusals keep their HTTP status
                    role_usage = None if usage is None else Usage(usage.prompt_tokens, 0)  # it shows no token
                    yield job.wire.role_chunk(index, role_usage)
                yield job.wire.chunk(result, delta, usage)
        if job.stored is not None:
            await self._kept(job, results)
        if job.include_usage:
            yield job.wire.usage_chunk(job.usage(results))

    async def _kept(self, job: Job, results: list[ChoiceResult]) -> dict:
        """The whole completion, once stored if the job is to be (before the client has all of it)."""
        body = job.wire.response(results, job.usage(results))
        if job.stored is not None:
            await self.chats.keep(body, job.stored, job.owner)
        return body

    async def ledger_record(self, key: str) -> dict | None:
        return await ledger_view(self.ledger, key)

    # --- running -----------------------------------------------------------------------------------

    def _deltas(self, job: Job) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """Every choice's deltas, interleaved as they arrive, with their wire index."""
        run = self._run_prompt if job.beam is None else self._run_beams
        if len(job.prompts) == 1:
            return run(job, 0)
        return _merge([run(job, p) for p in range(len(job.prompts))])

    async def _run_prompt(self, job: Job, p: int) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """Prompt p's choices through their finishing deltas. Leaving early aborts the engine request;
        a stop string aborts its own choice at once (rule 11)."""
        run = _PromptRun(job, p, self.tokenizer)
        await self.ledger.record(run.arrivals(), "ingress")
        outputs = self.engine.generate(run.request)
        start = last = time.perf_counter()
        try:
            with _failing(run):
                async for output in outputs:
                    step = run.feed(output)
                    if step is not None:
                        if isinstance(step.finish, String):
                            self.engine.abort(output.request_id)
                        now = time.perf_counter()
                        if last == start:
                            self.observer.first_token(now - start)
                        else:
                            self.observer.tokens(len(step.tokens), now - last)
                        last = now
                        yield run.index(output.request_id), step
                    if run.done:
                        break
        finally:
            await outputs.aclose()
            await asyncio.shield(self._account(run, time.perf_counter() - start))

    async def _run_beams(self, job: Job, p: int) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """Prompt p's choices by beam search (pegaserve/api/beam.py), each whole once the search ends.
        Every step's engine requests are requests of their own in the ledger, one token each."""
        run = _PromptRun(job, p, self.tokenizer)
        plan = job.prompts[p]
        await self.ledger.record(run.arrivals(), "ingress")
        start = time.perf_counter()
        step_numbers = itertools.count(1)
        alternatives = num_alternatives(job.beam, plan.sampling.num_top_logprobs)
        first_step: StepOutput | None = None  # the prompt's own step: its logprobs, what the prefix cache held

        async def step(contexts: list[tuple[int, ...]]) -> list[SampledToken]:
            nonlocal first_step
            number = next(step_numbers)
            requests = [EngineRequest(f"{run.request.request_id}-beam{number}.{i}", context,
                                      SamplingParams(temperature=0.0, num_top_logprobs=alternatives),
                                      StopPolicy(max_tokens=1, ignore_eos=True),
                                      num_prompt_logprobs=plan.num_prompt_logprobs if number == 1 else None,
                                      cache_salt=job.cache_salt(plan), priority=plan.priority)
                        for i, context in enumerate(contexts)]
            outputs = await self._one_token_each(requests, job.client_request_id)
            if number == 1:
                first_step = outputs[0]
            return [output.tokens[0] for output in outputs]

        new_stream = run.new_stream if plan.stops.strings else None
        try:
            with _failing(run):
                beams = await beam_search(step, plan.prompt_token_ids, plan.policy, job.beam,
                                          plan.sampling.num_top_logprobs, new_stream)
            self.observer.first_token(time.perf_counter() - start)
            for choice_id, found in zip(run.choice_ids, beams):
                yield run.index(choice_id), run.feed(final_output(choice_id, found, first_step))
        finally:
            await asyncio.shield(self._account(run, time.perf_counter() - start))

    async def _one_token_each(self, requests: list[EngineRequest], client_id: str | None) -> list[StepOutput]:
        """Each request's one token, the requests run together; each has its record in the ledger,
        marked internal (the summary counts it apart from the clients' choices)."""
        got: dict[str, StepOutput] = {}

        async def one(request: EngineRequest) -> None:
            async with aclosing(self.engine.generate(request)) as outputs:
                async for output in outputs:
                    earlier = got.get(output.request_id)
                    got[output.request_id] = output if earlier is None else earlier.then(output)

        await self.ledger.record([Arrived(r.request_id, len(r.prompt_token_ids), 1, client_id, internal=True)
                                  for r in requests], "ingress")
        tasks = [asyncio.create_task(one(r)) for r in requests]
        unfinished: StopCause = Abort()
        try:
            await asyncio.gather(*tasks)
        except Exception as exc:
            unfinished = Error(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            events: list[LedgerEvent] = []
            for r in requests:
                output, size = got.get(r.request_id), len(r.prompt_token_ids)
                if output is not None and output.finish is not None:
                    events += [TokensCommitted(r.request_id, tuple(t.token_id for t in output.tokens)),
                               Finished(r.request_id, output.finish, size, len(output.tokens))]
                else:
                    events.append(Finished(r.request_id, unfinished, size, 0))
            await asyncio.shield(self.ledger.record(events, "ingress"))
        return [got[r.request_id] for r in requests]

    async def _account(self, run: _PromptRun, e2e_s: float) -> None:
        for j, cause, prompt_tokens, num_tokens in run.outcomes():
            if isinstance(cause, Error):
                log.warning("request %s (client id %r) choice %d failed: %s", run.job.response_id,
                            run.job.client_request_id, j, cause.message)
            self.observer.finished(cause, prompt_tokens, num_tokens, e2e_s)
        await self.ledger.record(run.finishes(), "ingress")


class _PromptRun:
    """One prompt's choices while they run: each its `ChoiceStream`, owned here."""

    def __init__(self, job: Job, p: int, tokenizer: Tokenizer) -> None:
        self.job = job
        self.request = job.engine_request(p)
        self._p, self._tokenizer = p, tokenizer
        self._choice_ids = [self.request.choice_id(j) for j in range(job.n)]
        self._first_index = p * job.n
        self._streams = {c: self.new_stream() for c in self._choice_ids}
        self._running = set(self._choice_ids)
        self._scores = None  # the prompt's scores, which its choices share

    @property
    def done(self) -> bool:
        return not self._running

    @property
    def choice_ids(self) -> list[str]:
        return list(self._choice_ids)

    def new_stream(self) -> ChoiceStream:
        """A fresh stream with this prompt's stop strings and text rules."""
        plan = self.job.prompts[self._p]
        return ChoiceStream(self._tokenizer.detokenizer(plan.skip_special_tokens), plan.stops, plan.policy.min_tokens)

    def index(self, choice_id: str) -> int:
        return self._first_index + self._choice_ids.index(choice_id)

    def feed(self, output: StepOutput) -> ChoiceDelta | None:
        """The delta `output` gives its choice's client, if any."""
        if output.request_id not in self._running:
            return None  # a choice a stop string ended: what the engine made after it is discarded
        if output.prompt_logprobs is not None:
            # The choice that prefilled the prompt scored all of it; the others share that.
            if self._scores is None or len(output.prompt_logprobs) > len(self._scores):
                self._scores = output.prompt_logprobs
            output = replace(output, prompt_logprobs=self._scores)
        stream = self._streams[output.request_id]
        delta = stream.feed(output)
        if stream.finish is not None:
            self._running.discard(output.request_id)
        return delta

    def fail(self, exc: Exception) -> None:
        for stream in self._streams.values():
            if stream.finish is None:
                stream.finish = Error(f"{type(exc).__name__}: {exc}")

    def arrivals(self) -> list[LedgerEvent]:
        return [Arrived(c, prompt_tokens, self.request.policy.max_tokens, self.job.client_request_id)
                for (c, prompt_tokens) in zip(self._choice_ids, self._prompt_shares())]

    def outcomes(self) -> list[tuple[int, StopCause, int, int]]:
        """(choice, cause, prompt tokens it accounts for, its tokens); no finish: the client went away."""
        return [(j, stream.finish or Abort(), prompt_tokens, stream.num_tokens)
                for j, (stream, prompt_tokens) in enumerate(zip(self._streams.values(), self._prompt_shares()))]

    def finishes(self) -> list[LedgerEvent]:
        events: list[LedgerEvent] = []
        for choice_id, (_, cause, prompt_tokens, num_tokens) in zip(self._choice_ids, self.outcomes()):
            events += [TokensCommitted(choice_id, tuple(self._streams[choice_id].token_ids)),
                       Finished(choice_id, cause, prompt_tokens, num_tokens)]
        return events

    def _prompt_shares(self) -> list[int]:
        """The choices share one prefill: the first accounts for the prompt, so records sum to the usage."""
        return [len(self.request.prompt_token_ids) if j == 0 else 0 for j in range(self.job.n)]


@contextmanager
def _failing(run: _PromptRun):
    """An engine's failure as the client's error; the run's choices end with it."""
    try:
        yield
    except RequestRejected as exc:
        run.fail(exc)
        raise ApiError(str(exc), param="prompt") from exc
    except EngineOverloaded as exc:
        run.fail(exc)
        raise ApiError("the server is at capacity; retry later", status=429) from exc
    except Exception as exc:  # a replica died, a transfer broke: the request fails, the server does not
        log.exception("request %s (client id %r) failed", run.request.request_id, run.job.client_request_id)
        run.fail(exc)
        raise ApiError(FAILED, status=500) from exc


async def _merge(streams: list[AsyncIterator]) -> AsyncIterator:
    """Interleave several iterators' items as they arrive; the first failure ends the merge and
    cancels the rest."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator) -> None:
        try:
            async for item in stream:
                await queue.put((True, item))
        except Exception as exc:  # handed to the consumer, who raises it
            await queue.put((False, exc))
        else:
            await queue.put((True, done))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            ok, item = await queue.get()
            if not ok:
                raise item
            if item is done:
                remaining -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def now_s() -> int:
    return int(time.time())
