"""The lifecycle ledger as a named Ray actor hosting a `pegaserve.ledger.Ledger`, and the buffer each
replica records through, and the ingress's `LedgerClient` over them.

Events reach the ledger on a direct connection per replica (pegaserve/net/channel.py), not as Ray
calls: on the 2-core dev machine a Ray actor call costs its caller ~1.5 ms of CPU and the actor
~1 ms, a frame a socket write; with a few calls per request from the ingress, prefill and decode
replicas that was ~0.07 CPU-ms per output token. Reads (`get`, `summary`) and heartbeats, rare,
stay Ray calls.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import ray

from pegaserve.api.services import LedgerClient
from pegaserve.deployments.node import node_listener
from pegaserve.ledger import Finished, Ledger, LedgerEvent
from pegaserve.net.channel import Address, Connection, connect

log = logging.getLogger("ray.serve")
LEDGER_NAME = "pegaserve-ledger"
NAMESPACE = "pegaserve"
LEDGER_NAMESPACE = NAMESPACE
FLUSH_PERIOD_S = 0.01
RECONNECT_DELAY_S = 0.5
MAX_UNACKED_BATCHES = 10_000  # a ledger gone for good must not grow a replica's memory without end


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class LedgerActor:
    """Restarted by Ray when it dies; calls made meanwhile are retried, and finished records come
    back from the journal."""

    def __init__(self, max_records: int = 10_000, journal: str | None = None) -> None:
        self.ledger = Ledger(max_records, journal)
        self.alive_until: dict[str, float] = {}  # an ingress -> when its silence means it died
        self.applied: dict[str, int] = {}  # a replica -> the last batch of its recorded here (its seq)
        self._listener = node_listener(self._serve)
        self._listening: asyncio.Future | None = None

    async def channel(self) -> Address:
        """Where a replica connects to send its events: frames of `(seq, batches)`, each recorded
        as `record` would, in order, and acknowledged with its `seq`."""
        if self._listening is None:
            self._listening = asyncio.ensure_future(self._listener.start())
        return await asyncio.shield(self._listening)

    async def _serve(self, connection: Connection) -> None:
        """Each batch is recorded once: one sent again (its ack was lost with a connection) is only
        acknowledged again."""
        while (message := await connection.recv()) is not None:
            seq, batches = message
            sender = batches[0][0] if batches else ""
            if seq > self.applied.get(sender, 0):
                self.applied[sender] = seq
                self.record(batches)
            connection.send(seq)

    def record(self, batches: list[tuple[str, list[LedgerEvent]]]) -> None:
        now = time.time()
        for component, events in batches:
            self.ledger.record(events, component, now)
        self._end_orphans(now)

    def heartbeat(self, component: str, timeout_s: float) -> None:
        """`component` (an ingress replica) is alive; if silent for `timeout_s`, it is not, and the
        records of requests it had in flight end as errors instead of staying open for good."""
        now = time.time()
        self.alive_until[component] = now + timeout_s
        self._end_orphans(now)

    def _end_orphans(self, now: float) -> None:
        silent = {c for c, until in self.alive_until.items() if until < now}
        if silent:
            self.ledger.end_orphans(silent, f"its ingress ({', '.join(sorted(silent))}) stopped answering")
            for component in silent:
                del self.alive_until[component]

    def get(self, request_id: str) -> dict | None:
        return self.ledger.get(request_id)

    def summary(self) -> dict:
        self._end_orphans(time.time())
        return self.ledger.summary()


def _resolve(waiters: list[asyncio.Future]) -> None:
    for waiter in waiters:
        if not waiter.done():
            waiter.set_result(None)


def ledger_actor(max_records: int, journal: str | None):
    """The one ledger of this Ray cluster; detached so it outlives the app that made it."""
    return LedgerActor.options(name=LEDGER_NAME, namespace=NAMESPACE, get_if_exists=True,
                               lifetime="detached").remote(max_records, journal)


class DetachedCalls:
    """Ray actor calls made on a request's behalf but not as its children: Serve cancels a
    cancelled request's child tasks, and a cancelled actor call leaves a gap in the calls'
    sequence that stalls that actor for every caller (~30 s). Calls start from one long-lived
    task made at replica start, and the caller awaits their result shielded."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue = asyncio.Queue()
        self._runner = asyncio.ensure_future(self._run())

    async def call(self, make_call):
        """`await make_call()` off the request: e.g. `call(lambda: actor.get.remote(key))`."""
        done = asyncio.get_running_loop().create_future()
        self._queue.put_nowait((make_call, done))
        return await asyncio.shield(done)

    async def _run(self) -> None:
        while True:
            make_call, done = await self._queue.get()
            asyncio.ensure_future(self._one(make_call, done))  # started here: this task's context

    @staticmethod
    async def _one(make_call, done: asyncio.Future) -> None:
        try:
            result = await make_call()
        except Exception as exc:
            if not done.done():
                done.set_exception(exc)
        else:
            if not done.done():
                done.set_result(result)


class LedgerBuffer:
    """Ledger events from one replica, sent in batches (a frame per 10 ms at most, not one per
    event) on the replica's connection to the ledger actor. `record` queues; `await
    record_now(...)` sends everything queued and waits until the ledger has recorded it (the
    ingress does, at a request's finish, so the ledger agrees with the answer before it ends).

    A batch stays here until the ledger acknowledges it: if the ledger dies (Ray restarts it),
    the batches it had not acknowledged go again, in order, to the restarted one, as Ray retries
    a call to a restarted actor. The connection is made from one long-lived task, never from a
    request's own: Serve cancels a cancelled request's child tasks, and a cancelled actor call
    would leave a gap in the calls' sequence that stalls the ledger actor for every caller.
    """

    def __init__(self, actor, component: str) -> None:
        self.actor = actor
        self.component = component
        self.detached = DetachedCalls()  # reads (get, summary) leave off the request too
        self._queued: list[LedgerEvent] = []
        self._waiters: list[asyncio.Future] = []
        self._unacked: dict[int, tuple[list[LedgerEvent], list[asyncio.Future]]] = {}  # seq -> batch, in order
        self._seqs = itertools.count(1)
        self._connection: Connection | None = None
        self._wake = asyncio.Event()
        self._urgent = False
        self._sender = asyncio.ensure_future(self._send_forever())

    def record(self, events: list[LedgerEvent]) -> None:
        self._queued += events
        self._wake.set()

    async def record_now(self, events: list[LedgerEvent]) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._queued += events
        self._waiters.append(waiter)
        self._urgent = True
        self._wake.set()
        await asyncio.shield(waiter)

    async def _send_forever(self) -> None:
        while True:
            await self._wake.wait()
            if not self._urgent:
                await asyncio.sleep(FLUSH_PERIOD_S)  # gather what else comes meanwhile
            self._wake.clear()
            self._urgent = False
            if self._queued or self._waiters:
                seq = next(self._seqs)
                self._unacked[seq] = (self._queued, self._waiters)
                self._queued, self._waiters = [], []
                self._bound_unacked()
                if self._connection is not None:
                    self._send(seq)
                    continue
            if self._unacked and self._connection is None:
                try:
                    await self._reconnect()
                except Exception:  # the ledger restarts on its own; requests must not wait or fail meanwhile
                    log.warning("cannot reach the ledger; %d batches wait", len(self._unacked), exc_info=True)
                    for _, waiters in self._unacked.values():
                        _resolve(waiters)
                        waiters.clear()
                    await asyncio.sleep(RECONNECT_DELAY_S)
                    self._wake.set()

    async def _reconnect(self) -> None:
        """Connect (to a restarted ledger, it may be) and send every batch it has not acknowledged."""
        address = await self.actor.channel.remote()  # waits while Ray restarts the actor
        connection = await connect(address, self.component)
        self._connection = connection
        asyncio.ensure_future(self._read_acks(connection))
        for seq in list(self._unacked):
            self._send(seq)

    def _send(self, seq: int) -> None:
        self._connection.send((seq, [(self.component, self._unacked[seq][0])]))

    async def _read_acks(self, connection: Connection) -> None:
        while (seq := await connection.recv()) is not None:
            for done in [s for s in self._unacked if s <= seq]:
                _resolve(self._unacked.pop(done)[1])
        log.warning("the connection to the ledger ended; %d batches go again once it is back", len(self._unacked))
        if self._connection is connection:
            self._connection = None
            self._wake.set()

    def _bound_unacked(self) -> None:
        while len(self._unacked) > MAX_UNACKED_BATCHES:
            events, waiters = self._unacked.pop(next(iter(self._unacked)))
            log.error("the ledger has been unreachable too long: %d events dropped", len(events))
            _resolve(waiters)

    async def heartbeat_forever(self, timeout_s: float) -> None:
        """Tell the ledger this ingress lives, a few times per `timeout_s`."""
        while True:
            try:
                await self.actor.heartbeat.remote(self.component, timeout_s)
            except Exception:
                log.warning("ledger heartbeat failed", exc_info=True)
            await asyncio.sleep(min(5.0, timeout_s / 3))


class ActorLedgerClient(LedgerClient):
    """Events queue in a buffer sent every few milliseconds; a request's finish is sent at once
    (and awaited), so the ledger agrees with an answer before the answer ends."""

    def __init__(self, buffer: LedgerBuffer) -> None:
        self.buffer = buffer

    async def record(self, events: list[LedgerEvent], component: str) -> None:
        if any(isinstance(e, Finished) for e in events):
            await self.buffer.record_now(events)
        else:
            self.buffer.record(events)

    def queue(self, events: list[LedgerEvent]) -> None:
        self.buffer.record(events)

    async def get(self, request_id: str) -> dict | None:
        return await self.buffer.detached.call(lambda: self.buffer.actor.get.remote(request_id))

    async def summary(self) -> dict:
        return await self.buffer.detached.call(lambda: self.buffer.actor.summary.remote())
