"""Running requests: one engine request per choice, stop strings applied on the way out, the
ledger told what the client was given. Streaming and non-streaming share this path."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pegaserve.api.choice import ChoiceDelta, ChoiceStream
from pegaserve.api.clients import EngineClient, LedgerClient
from pegaserve.api.errors import ApiError
from pegaserve.api.observer import RequestObserver
from pegaserve.api.validation import ChoicePlan, Limits, ModelInfo
from pegaserve.api.wire import ChoiceResult, Wire
from pegaserve.engine.engine import EngineOverloaded, RequestRejected
from pegaserve.engine.request import EngineRequest
from pegaserve.ledger import Arrived, Finished, TokensCommitted
from pegaserve.stop import Abort, Error
from pegaserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One HTTP request: its id, its choices' plans, and how to format them."""

    request_id: str
    plans: list[ChoicePlan]
    wire: Wire
    stream: bool
    include_usage: bool

    def engine_request_id(self, index: int) -> str:
        return self.request_id if len(self.plans) == 1 else f"{self.request_id}-{index}"


def new_request_id(prefix: str, client_id: str | None) -> str:
    return client_id if client_id else f"{prefix}-{uuid.uuid4().hex}"


class Server:
    def __init__(self, engine: EngineClient, tokenizer: Tokenizer, model: ModelInfo, ledger: LedgerClient,
                 limits: Limits = Limits(), observer: RequestObserver | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model = model
        self.ledger = ledger
        self.limits = limits
        self.observer = observer or RequestObserver()

    async def run_choice(self, request_id: str, plan: ChoicePlan) -> AsyncIterator[ChoiceDelta]:
        """The choice's deltas through its finishing one. Leaving early aborts the engine request."""
        spec = EngineRequest(request_id, plan.prompt_token_ids, plan.sampling, plan.policy)
        choice = ChoiceStream(self.tokenizer.detokenizer(plan.skip_special_tokens), plan.stops,
                              plan.policy.min_tokens)
        await self.ledger.record([Arrived(request_id, len(plan.prompt_token_ids), plan.policy.max_tokens)], "ingress")
        outputs = self.engine.generate(spec)
        start = last = time.perf_counter()
        try:
            async for output in outputs:
                delta = choice.feed(output)
                if delta is not None:
                    now = time.perf_counter()
                    if last == start:
                        self.observer.first_token(now - start)
                    else:
                        self.observer.tokens(len(delta.tokens), now - last)
                    last = now
                    yield delta
                if choice.finish is not None:
                    break
        except RequestRejected as exc:
            choice.finish = Error(str(exc))
            raise ApiError(str(exc), param="prompt") from exc
        except EngineOverloaded as exc:
            choice.finish = Error(str(exc))
            raise ApiError(f"the server is at capacity; retry later ({exc})", status=429) from exc
        except Exception as exc:  # a replica died, a transfer broke: the request fails, the server does not
            choice.finish = Error(str(exc))
            raise
        finally:
            await outputs.aclose()  # rule 11: a string stop aborts the engine request at once
            cause = choice.finish or Abort()  # no finish: the client went away
            self.observer.finished(cause, len(plan.prompt_token_ids), choice.num_tokens, time.perf_counter() - start)
            events = [TokensCommitted(request_id, tuple(choice.token_ids)),
                      Finished(request_id, cause, len(plan.prompt_token_ids), choice.num_tokens)]
            await asyncio.shield(self.ledger.record(events, "ingress"))

    async def complete(self, job: Job) -> dict:
        """Non-streaming: run every choice to its end, then one body."""
        results = [ChoiceResult(i, plan.prompt_token_ids) for i, plan in enumerate(job.plans)]

        async def run(i: int) -> None:
            async for delta in self.run_choice(job.engine_request_id(i), job.plans[i]):
                results[i].add(delta)

        await asyncio.gather(*(run(i) for i in range(len(job.plans))))
        for result in results:
            if isinstance(result.finish, Error):
                raise ApiError(f"the server failed the request: {result.finish.message}", status=500)
        return job.wire.response(results)

    async def stream(self, job: Job) -> AsyncIterator[dict]:
        """Streaming: chunks as they come, one finishing chunk per choice, then usage."""
        results = [ChoiceResult(i, plan.prompt_token_ids) for i, plan in enumerate(job.plans)]
        started: set[int] = set()
        async for i, delta in _merge([self.run_choice(job.engine_request_id(i), p) for i, p in enumerate(job.plans)]):
            results[i].add(delta)
            if isinstance(delta.finish, Error):
                yield ApiError(f"the server failed the request: {delta.finish.message}", status=500).body()
                return
            first = i not in started
            started.add(i)
            if first and job.wire.chat:
                yield job.wire.role_chunk(i)  # after admission, so refusals are still HTTP statuses
            yield job.wire.chunk(i, delta, results[i].prompt_token_ids if first and job.wire.return_token_ids else None)
        if job.include_usage:
            yield job.wire.usage_chunk(results)


async def _merge(streams: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[tuple[int, ChoiceDelta]]:
    """Interleave several choices' deltas as they arrive; one stream needs no tasks."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream: AsyncIterator[ChoiceDelta]) -> None:
        try:
            async for delta in stream:
                await queue.put((i, delta))
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            else:
                yield item
        for task in tasks:
            task.result()  # surface a choice's failure
    finally:
        for task in tasks:
            task.cancel()


def now_s() -> int:
    return int(time.time())
