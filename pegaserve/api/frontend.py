"""Running requests: one engine request per prompt (its `n` choices share the prefill), each
choice's stop strings applied on the way out, the ledger told what each choice's client was given.
Streaming and non-streaming share this path."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace

from pegaserve.api.choice import ChoiceDelta, ChoiceStream
from pegaserve.api.clients import EngineClient, LedgerClient
from pegaserve.api.errors import ApiError
from pegaserve.api.ledger_view import ledger_view
from pegaserve.api.model_info import ModelInfo
from pegaserve.api.observer import RequestObserver
from pegaserve.api.validation import Limits, PromptPlan
from pegaserve.api.wire import ChoiceResult, Usage, Wire
from pegaserve.engine.engine import EngineOverloaded, RequestRejected
from pegaserve.engine.request import EngineRequest
from pegaserve.ledger import Arrived, Finished, LedgerEvent, TokensCommitted
from pegaserve.stop import Abort, Error, String
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

    def engine_request(self, p: int) -> EngineRequest:
        """Prompt p's engine request; its id is unique per HTTP request and per prompt."""
        plan = self.prompts[p]
        request_id = self.response_id if len(self.prompts) == 1 else f"{self.response_id}-{p}"
        return EngineRequest(request_id, plan.prompt_token_ids, plan.sampling, plan.policy, n=self.n,
                             num_prompt_logprobs=plan.num_prompt_logprobs)

    def results(self) -> list[ChoiceResult]:
        return [ChoiceResult(p * self.n + j, plan.prompt_token_ids, plan.echo_text)
                for p, plan in enumerate(self.prompts) for j in range(self.n)]

    def usage(self, results: list[ChoiceResult]) -> Usage:
        """The prompts once each (their choices share them), every choice's tokens."""
        return Usage(sum(len(p.prompt_token_ids) for p in self.prompts), sum(len(r.tokens) for r in results))


def new_response_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class Frontend:
    """Runs a request's choices on an engine client, applies stop strings, tells the ledger."""

    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model: ModelInfo, ledger: LedgerClient,
                 limits: Limits = Limits(), observer: RequestObserver | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.ledger = ledger
        self.limits = limits
        self.observer = observer or RequestObserver()

    async def complete(self, job: Job) -> dict:
        """Non-streaming: run every choice to its end, then one body."""
        results = job.results()
        async with aclosing(self._deltas(job)) as deltas:
            async for index, delta in deltas:
                results[index].add(delta)
        if any(isinstance(r.finish, Error) for r in results):
            raise ApiError(FAILED, status=500)
        return job.wire.response(results, job.usage(results))

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
                if result.num_deltas == 1 and job.wire.chat:
                    yield job.wire.role_chunk(index, usage)  # after admission: refusals keep their HTTP status
                yield job.wire.chunk(result, delta, usage)
        if job.include_usage:
            yield job.wire.usage_chunk(job.usage(results))

    async def ledger_record(self, key: str) -> dict | None:
        return await ledger_view(self.ledger, key)

    # --- running -----------------------------------------------------------------------------------

    def _deltas(self, job: Job) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """Every choice's deltas, interleaved as they arrive, with their wire index."""
        return _merge([self._run_prompt(job, p) for p in range(len(job.prompts))])

    async def _run_prompt(self, job: Job, p: int) -> AsyncIterator[tuple[int, ChoiceDelta]]:
        """Prompt p's choices through their finishing deltas. Leaving early aborts the engine request;
        a stop string aborts its own choice at once (rule 11)."""
        request, plan = job.engine_request(p), job.prompts[p]
        choice_ids = [request.choice_id(j) for j in range(job.n)]
        indices = {c: p * job.n + j for j, c in enumerate(choice_ids)}
        streams = {c: ChoiceStream(self.tokenizer.detokenizer(plan.skip_special_tokens), plan.stops,
                                   plan.policy.min_tokens) for c in choice_ids}
        running = set(choice_ids)
        num_prompt_tokens = len(plan.prompt_token_ids)
        scores = None  # the prompt's scores, which its choices share
        await self.ledger.record([Arrived(c, num_prompt_tokens if j == 0 else 0, plan.policy.max_tokens,
                                          job.client_request_id) for j, c in enumerate(choice_ids)], "ingress")
        outputs = self.engine.generate(request)
        start = last = time.perf_counter()
        try:
            async for output in outputs:
                if output.request_id not in running:
                    continue  # a choice a stop string ended: what the engine made after it is discarded
                if output.prompt_logprobs is not None:
                    # The choice that prefilled the prompt scored all of it; the others share that.
                    if scores is None or len(output.prompt_logprobs) > len(scores):
                        scores = output.prompt_logprobs
                    output = replace(output, prompt_logprobs=scores)
                stream = streams[output.request_id]
                delta = stream.feed(output)
                if stream.finish is not None:
                    running.discard(output.request_id)
                    if isinstance(stream.finish, String):
                        self.engine.abort(output.request_id)
                if delta is not None:
                    now = time.perf_counter()
                    if last == start:
                        self.observer.first_token(now - start)
                    else:
                        self.observer.tokens(len(delta.tokens), now - last)
                    last = now
                    yield indices[output.request_id], delta
                if not running:
                    break
        except RequestRejected as exc:
            self._fail(streams, exc)
            raise ApiError(str(exc), param="prompt") from exc
        except EngineOverloaded as exc:
            self._fail(streams, exc)
            raise ApiError("the server is at capacity; retry later", status=429) from exc
        except Exception as exc:  # a replica died, a transfer broke: the request fails, the server does not
            log.exception("request %s (client id %r) failed", request.request_id, job.client_request_id)
            self._fail(streams, exc)
            raise ApiError(FAILED, status=500) from exc
        finally:
            await outputs.aclose()
            await asyncio.shield(self._account(job, request, streams, time.perf_counter() - start))

    def _fail(self, streams: dict[str, ChoiceStream], exc: Exception) -> None:
        for stream in streams.values():
            if stream.finish is None:
                stream.finish = Error(f"{type(exc).__name__}: {exc}")

    async def _account(self, job: Job, request: EngineRequest, streams: dict[str, ChoiceStream], e2e_s: float) -> None:
        events: list[LedgerEvent] = []
        for j, (choice_id, stream) in enumerate(streams.items()):
            cause = stream.finish or Abort()  # no finish: the client went away
            if isinstance(cause, Error):
                log.warning("request %s (client id %r) choice %d failed: %s", job.response_id,
                            job.client_request_id, j, cause.message)
            prompt_tokens = len(request.prompt_token_ids) if j == 0 else 0
            self.observer.finished(cause, prompt_tokens, stream.num_tokens, e2e_s)
            events += [TokensCommitted(choice_id, tuple(stream.token_ids)),
                       Finished(choice_id, cause, prompt_tokens, stream.num_tokens)]
        await self.ledger.record(events, "ingress")


async def _merge(streams: list[AsyncIterator]) -> AsyncIterator:
    """Interleave several iterators' items as they arrive (one needs no tasks); the first failure
    ends the merge and cancels the rest."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
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
