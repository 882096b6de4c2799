"""The ingress's engine clients over Serve: P/D (prefill first, decode only for a non-terminal
first token, docs/contract.md rule 21) and colocated, with the release of leases it will not use.

Tokens come back through the ingress's `TokenInbox`, one frame per engine step. A request whose
replica dies (or whose stream breaks) after tokens were sent resumes on another replica from
exactly the tokens this ingress already received — the client's stream continues with no
duplicate and no gap; greedy and seeded requests produce what an undisturbed run would have.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable

from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError

from pegaserve.api.services import EngineClient
from pegaserve.deployments.calls import Choices, ColocatedCall, DecodeCall, PrefillResult, pack, unpack
from pegaserve.deployments.ledger import ActorLedgerClient
from pegaserve.deployments.metrics import MigrationMetrics
from pegaserve.deployments.registry import kv_servers, stats_board
from pegaserve.ledger import Migrated, Prefilled
from pegaserve.messages import EngineOverloaded, EngineRequest, RequestRejected, SampledToken, StepOutput
from pegaserve.net.channel import Address, Connection, connect
from pegaserve.net.tokens import TokenInbox
from pegaserve.pd.protocol import ReleaseLease
from pegaserve.sched.stream_interval import StreamInterval

log = logging.getLogger("ray.serve")
LATE_FRAMES_S = 10.0  # a call may return before its last frames arrive (they travel apart)
BACKPRESSURE_RETRY_S = 0.2


class EngineFailed(RuntimeError):
    """The request's replica failed and it could not be resumed (no details for the client)."""


class _CallEnded:
    """Put in a request's queue when the Serve call that runs it returns (error None) or fails."""

    def __init__(self, tag: int, error: BaseException | None) -> None:
        self.tag, self.error = tag, error


class _Wake:
    """Put in a request's queue when one of its choices was aborted (it may be the last)."""


StartCall = Callable[[Choices, int, bool], object]  # (choices with their tokens, tag, resume?) -> response


class _ServeEngineClient(EngineClient):
    def __init__(self, inbox: TokenInbox, name: str, model: str, max_migrations: int,
                 ledger: ActorLedgerClient, stream_interval: int = 1) -> None:
        self.inbox = inbox
        self.stream_interval = stream_interval
        self.name = name
        self.max_migrations = max_migrations
        self.ledger = ledger
        self.migrations = MigrationMetrics(model)
        self._board = stats_board()
        self._app_prefix = name.split("/")[0] + "/"
        self._tags = itertools.count(1)
        self._live: dict[str, tuple[dict, asyncio.Queue]] = {}  # choice id -> its request's (running, queue)

    def abort(self, choice_id: str) -> None:
        """One choice stops (a stop string fired in it): here, so no resume restarts it, and on
        its replica."""
        live = self._live.pop(choice_id, None)
        if live is not None:
            running, queue = live
            running.pop(choice_id, None)
            queue.put_nowait(_Wake())
        self.inbox.abort(choice_id)

    async def stats(self) -> dict:
        return await self.ledger.buffer.detached.call(lambda: self._board.read.remote(prefix=self._app_prefix))

    def _track(self, running: dict[str, list[SampledToken]]) -> asyncio.Queue:
        """From now on `abort` of one of these choices takes it out of `running` (until `_untrack`)."""
        queue: asyncio.Queue = asyncio.Queue()
        for choice_id in running:
            self._live[choice_id] = (running, queue)
        return queue

    def _untrack(self, request: EngineRequest) -> None:
        for i in range(request.n):
            self._live.pop(request.choice_id(i), None)

    async def _stream(self, request: EngineRequest, running: dict[str, list[SampledToken]], queue: asyncio.Queue,
                      start: StartCall) -> AsyncIterator[StepOutput]:
        """The outputs of the `running` choices (each with its tokens so far) until all finish,
        resuming them elsewhere when their replica fails."""
        index = {request.choice_id(i): i for i in range(request.n)}
        call = watcher = None
        num_migrations = 0
        try:
            while running:
                tag = next(self._tags)
                self.inbox.open(list(running), queue, tag)
                choices = tuple((index[c], tuple(tokens)) for c, tokens in running.items())
                call = start(choices, tag, num_migrations > 0)
                watcher = asyncio.ensure_future(_watch(call, queue, tag))
                failure = None
                outputs = _outputs_until_failure(queue, running, tag) if self.stream_interval == 1 \
                    else _until_failure(queue, running, tag, self.stream_interval)
                async for output in outputs:
                    if isinstance(output, BaseException):
                        failure = output
                        break
                    yield output
                if running:
                    call.cancel()
                    watcher.cancel()
                    if isinstance(failure, BackPressureError):
                        if not any(running.values()):  # nothing shown yet: the client may retry (429)
                            raise EngineOverloaded("the server is at capacity") from None
                        await asyncio.sleep(BACKPRESSURE_RETRY_S)  # tokens were shown: wait for room
                        continue
                    num_migrations += 1
                    self._migrate(request, running, failure, num_migrations)
        finally:
            self.inbox.close(list(index))
            if running and call is not None:  # the request was given up: so is its call
                watcher.cancel()
                call.cancel()
            # Every choice finished or was aborted: the call ends on its own within a step, its
            # watcher with it. Cancelling them would cancel a call all but done: a cancel message
            # and its handling on both replicas, and a log line (Serve's), for a good share of requests.

    def _migrate(self, request: EngineRequest, running: dict[str, list[SampledToken]], failure, attempt: int) -> None:
        if isinstance(failure, RequestRejected | EngineOverloaded):
            raise failure
        reason = f"{type(failure).__name__}" if failure is not None else "the stream ended early"
        log.warning("request %s: its replica failed (%s); resuming (%d/%d)", request.request_id, failure, attempt,
                    self.max_migrations)
        if attempt > self.max_migrations:
            raise EngineFailed(f"the request failed after {self.max_migrations} attempts to resume it")
        self.migrations.migrated()
        self.ledger.queue([Migrated(c, self.inbox.sender_of(c) or "unknown", len(tokens), reason)
                           for c, tokens in running.items()])


async def _watch(call, queue: asyncio.Queue, tag: int) -> None:
    try:
        await call
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        queue.put_nowait(_CallEnded(tag, exc))
    else:
        queue.put_nowait(_CallEnded(tag, None))


async def _until_failure(queue: asyncio.Queue, running: dict[str, list[SampledToken]], tag: int,
                         stream_interval: int):
    """`_outputs_until_failure` through the app's stream interval (`pegaserve.sched.stream_interval`)."""
    interval = StreamInterval(stream_interval)
    async for item in _outputs_until_failure(queue, running, tag):
        if isinstance(item, BaseException):
            for held in interval.flush():  # what was received is shown before a resume elsewhere
                yield held
            yield item
        elif (message := interval.push(item)) is not None:
            yield message
    for held in interval.flush():
        yield held


async def _outputs_until_failure(queue: asyncio.Queue, running: dict[str, list[SampledToken]], tag: int):
    """Outputs (updating `running`) until every choice finished, or a failure (yielded as the
    exception). Once per token of every running request: kept lean."""
    deadline = None
    while running:
        if deadline is None:
            item = await queue.get()
        else:
            try:
                item = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                yield EngineFailed("the stream ended early")
                return
        if isinstance(item, _Wake):
            continue
        if isinstance(item, _CallEnded):
            if item.tag != tag:
                continue
            if item.error is not None and not isinstance(item.error, asyncio.CancelledError):
                yield item.error if isinstance(item.error, Exception) else EngineFailed(str(item.error))
                return
            deadline = time.monotonic() + LATE_FRAMES_S
            continue
        if item.request_id not in running:
            continue  # an aborted choice's last words
        running[item.request_id] += item.tokens
        if item.finish is not None:
            del running[item.request_id]
        yield item


class DisaggregatedClient(_ServeEngineClient):
    """Prefill first; decode only when some choice's first token is not terminal (rule 21)."""

    def __init__(self, prefill, decode, inbox: TokenInbox, name: str, model: str, max_migrations: int,
                 ledger: ActorLedgerClient, stream_interval: int = 1) -> None:
        super().__init__(inbox, name, model, max_migrations, ledger, stream_interval)
        self._prefill_call = prefill.prefill  # (each attribute of a handle is a new handle)
        self._decode_call = decode.generate
        self.releaser = LeaseReleaser(name)

    async def _prefill(self, request: EngineRequest):
        """Prefill, retried once on another replica if the first one died (nothing was shown yet).
        If this caller gives up meanwhile, the prefill is cancelled and its lease released: a
        prefill that had finished already would otherwise hold its blocks until the lease expires."""
        for attempt in (1, 2):
            try:
                return unpack(await self._prefill_call.remote(pack(request)), PrefillResult)
            except asyncio.CancelledError:
                self.releaser.release_everywhere(self._app_prefix, request.request_id, self.ledger.buffer.detached)
                raise
            except BackPressureError as exc:
                raise EngineOverloaded("the prefill queue is full") from exc
            except RayActorError:
                if attempt == 2:
                    raise EngineFailed("the prefill replica failed") from None
                log.warning("prefill replica died under %s; retrying once", request.request_id)

    async def generate(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        result = await self._prefill(request)
        # in the ingress's buffer, ahead of the finish: the ledger has prefill's first token when the answer ends
        self.ledger.queue([Prefilled(o.request_id, o.tokens[0].token_id, o.tokens[0].logprob, result.replica)
                           for o in result.outputs if o.tokens])
        running = {o.request_id: list(o.tokens) for o in result.outputs if o.finish is None}
        queue = self._track(running)
        lease = result.lease
        carried = resumed = False  # a decode call carried the lease; one resumed without it

        def start(choices: Choices, tag: int, resume: bool):
            nonlocal carried, resumed
            if resume:
                resumed = True
            else:
                carried = True
            return self._decode_call.remote(pack(DecodeCall(request, choices, None if resume else lease,
                                                            self.inbox.address, tag)))

        try:
            for output in result.outputs:
                yield output
            if running:
                async for output in self._stream(request, running, queue, start):
                    yield output
        finally:
            self._untrack(request)
            # A decode call that carried the lease and ran every choice to its end had it: decode
            # frees its blocks, or tells prefill to (deployments/decode.py). Otherwise decode may
            # never claim it: free prefill's blocks now.
            if lease is not None and (running or not carried or resumed):
                self.releaser.release(lease.address, request.request_id)


class ColocatedClient(_ServeEngineClient):
    def __init__(self, colocated, inbox: TokenInbox, name: str, model: str, max_migrations: int,
                 ledger: ActorLedgerClient, stream_interval: int = 1) -> None:
        super().__init__(inbox, name, model, max_migrations, ledger, stream_interval)
        self._generate_call = colocated.generate  # (each attribute of a handle is a new handle)

    async def generate(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        running = {request.choice_id(i): [] for i in range(request.n)}
        queue = self._track(running)

        def start(choices: Choices, tag: int, resume: bool):
            return self._generate_call.remote(pack(ColocatedCall(request, self.inbox.address, tag,
                                                                 choices if resume else None)))

        try:
            async for output in self._stream(request, running, queue, start):
                yield output
        finally:
            self._untrack(request)


class LeaseReleaser:
    """Tells prefill replicas to free leases the ingress will not use, over direct connections."""

    def __init__(self, name: str, max_connections: int = 64) -> None:
        self.name = name
        self.max_connections = max_connections
        self._connections: OrderedDict[Address, Connection] = OrderedDict()

    def release(self, address: Address, request_id: str) -> None:
        asyncio.ensure_future(self._release(address, request_id))

    def release_everywhere(self, prefix: str, request_id: str, detached) -> None:
        """The prefill replica holding `request_id` is unknown: tell every live one of the app."""

        async def go() -> None:
            directory = kv_servers()
            for address in await detached.call(lambda: directory.addresses.remote(prefix)):
                await self._release(address, request_id)

        asyncio.ensure_future(go())

    async def _release(self, address: Address, request_id: str) -> None:
        try:
            connection = self._connections.get(address)
            if connection is None or connection.closed:
                connection = self._connections[address] = await connect(address, self.name)
                if len(self._connections) > self.max_connections:
                    self._connections.popitem(last=False)[1].close()
            connection.send(ReleaseLease(request_id))
        except (OSError, asyncio.TimeoutError):  # the prefill replica is gone, and its blocks with it
            log.warning("could not release the KV lease of %s", request_id)
