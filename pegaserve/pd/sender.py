"""The prefill side of the handoff: a KV server that decode replicas (fetches, copies done) and
ingress replicas (releases) connect to directly.

Leases are the engine's parked requests: the engine keeps their blocks until a release or the
lease's expiry; this server keeps no table of its own. Each connection's messages are served
strictly in order, so a pair channel's sends happen in the order its receiver expects; a pair that
carries its fetches itself has a thread of its own that sends the moment one arrives. The blocks
are read straight from the KV cache the engine process shares with this replica, and checked
against their generations once read — the engine loop is neither asked to copy nor to confirm.
What a lease carries besides, and what the pairs run on, is the transport's (pd/transports/).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import torch

from pegaserve.engine import commands
from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.ledger import KvSent
from pegaserve.messages import EngineRequest, ParkedKv, StepOutput
from pegaserve.net.channel import Address, Connection, Listener
from pegaserve.net.node import NodeInfo
from pegaserve.pd.pair_channel import MAX_FETCH_BYTES, PairChannel, Staging, block_bytes, fetch_in, packed_shape
from pegaserve.pd.protocol import Copied, Fetch, Lease, OpenPair, ReleaseLease
from pegaserve.pd.push import Pusher
from pegaserve.pd.transports.registry import make_transport

log = logging.getLogger("ray.serve")
TOMBSTONE_S = 120.0


class KvSender:
    """`transport`: the registry's name of it (pd/transports/registry.py); `node`: where this
    replica runs (its KV server listens on `node.ip`)."""

    def __init__(self, engine: AsyncEngine, name: str, transport: str, timeout_s: float, ledger,
                 delay_send_s: float = 0.0, push: bool = True, *, node: NodeInfo) -> None:
        self.engine = engine
        self.name = name
        self.transport = make_transport(transport, node)
        self.timeout_s = timeout_s
        self.ledger = ledger
        self.delay_send_s = delay_send_s  # a test double's fault: hold every send back this long
        self._listener = Listener(self._serve, node.ip)
        self._tombstones: dict[str, float] = {}  # released before they parked -> until when to remember
        self.push = push and self.transport.pushes  # push each lease's KV where it can (pd/push.py)
        self._pushers: dict[Connection, Pusher] = {}  # the pairs open that carry pushes, by their connection
        self.num_pairs = 0
        self.transport.warm_up()

    async def start(self) -> Address:
        return await self._listener.start()

    @property
    def pair_transport(self) -> str:
        """What a pair channel runs on (the transport's own, or the one it falls back on across nodes)."""
        return self.transport.pairs.name

    @property
    def serving(self) -> bool:
        return self._listener.serving

    @property
    def address(self) -> Address:
        assert self._listener.address is not None, "start() first"
        return self._listener.address

    async def lease(self, request: EngineRequest, outputs: list[StepOutput]) -> Lease:
        """The lease of a parked request (`outputs`: its choices' first outputs, which say where the
        prompt's KV is parked), with what the transport puts in it (`lease_kv`: a transport that
        moves the KV elsewhere now frees the blocks at once). Otherwise they stay parked until a
        fetch sends them (or the lease expires: then the fetch's bytes are turned away and decode
        recomputes)."""
        if self._tombstones.pop(request.request_id, None) is not None:
            self.engine.release(request.request_id)  # its ingress gave up while it was being prefilled
        cache = self.engine.kv_cache
        parked = next(o.parked for o in outputs if o.parked is not None)
        kv = await self.transport.lease_kv(self.engine, request.request_id, parked)
        pushed_to = self._push(request.request_id, parked, len(parked.block_ids) * block_bytes(cache))
        return Lease(request.request_id, self.name, self.address, packed_shape(cache, len(parked.block_ids)),
                     str(cache.dtype).removeprefix("torch."), block_bytes(cache), parked, kv.kv_ref, kv.shared,
                     pushed_to)

    def _push(self, request_id: str, parked: ParkedKv, num_bytes: int) -> str | None:
        """Push the lease's KV, in a worker thread, to the one decode replica paired (with several,
        which one will fetch is not known here) while its unclaimed pushes leave room; the pair's
        group name, or None (not pushed). A failure closes the pair and its connection: decode's
        claim fails at once and it recomputes; the lease is freed at its expiry."""
        if not self.push or len(self._pushers) != 1:
            return None
        connection, pusher = next(iter(self._pushers.items()))
        if not pusher.room_for(num_bytes):
            return None
        pusher.reserve(request_id, num_bytes, parked.held_until)

        def pushed(done: asyncio.Future) -> None:
            if not done.cancelled() and done.exception() is not None:
                log.warning("KV push of %s failed (%s)", request_id, done.exception())
                connection.close()  # and its pair (`_serve`)

        work = asyncio.get_running_loop().run_in_executor(pusher.executor, pusher.push, request_id, self.engine.kv_cache,
                                                          parked, self.engine.kv_generations, self.delay_send_s)
        work.add_done_callback(pushed)
        return pusher.group_name

    async def _serve(self, connection: Connection) -> None:
        """One peer's messages, in order."""
        try:
            await self._serve_messages(connection)
        finally:
            pusher = self._pushers.pop(connection, None)
            if pusher is not None:  # its pair ends with it
                pusher.close(self.timeout_s)

    async def _serve_messages(self, connection: Connection) -> None:
        pair: PairChannel | None = None
        staging = Staging()
        while (message := await connection.recv()) is not None:
            match message:
                case ReleaseLease(request_id):
                    await self._release(request_id)
                case OpenPair(group_name):
                    pair = await self._open_pair(connection, group_name)
                case Copied():
                    self._copied(connection, message)
                case Fetch():
                    if not await self._send(connection, pair, staging, message):
                        return  # the pair may be out of step: the peer starts over on a new connection
                case _:
                    log.warning("unexpected handoff message %r from %s", message, connection.peer)

    async def _open_pair(self, connection: Connection, group_name: str) -> PairChannel:
        pairs = self.transport.pairs
        if pairs is None:
            raise ConnectionError(f"transport {self.transport.name} opens no pair channel")
        pair = await pairs.offer_pair(connection, group_name, self.timeout_s)
        self.num_pairs += 1
        if pairs.pushable:
            self._pushers[connection] = Pusher(pair, group_name)
        if pair.carries_fetches:
            threading.Thread(target=self._serve_pair, args=(pair, connection, asyncio.get_running_loop()),
                             name=f"pegaserve-kv-pair-{self.num_pairs}", daemon=True).start()
        return pair

    def _serve_pair(self, pair: PairChannel, connection: Connection, loop: asyncio.AbstractEventLoop) -> None:
        """The thread of a pair that carries its own fetches: it waits for the next one and
        sends at once — neither this replica's event loop nor a hop to a worker thread stands
        between a fetch and its bytes (nor any Python, where the pair runs natively). It ends with
        the pair (the peer closed it) or a failed send."""
        buffer = torch.empty(MAX_FETCH_BYTES, dtype=torch.uint8)
        staging = Staging()
        while True:
            try:
                served = pair.serve_fetch(self.engine.kv_cache, self.engine.kv_generations, buffer, staging,
                                          self.delay_send_s)
                fetch, held, seconds = served.fetch, served.held, served.seconds
            except Exception:
                fetch, held, seconds = fetch_in(buffer), None, 0.0
                if fetch is not None:  # otherwise the peer closed the pair: it starts over on a new connection
                    log.exception("KV send of %s failed", fetch.request_id)
            try:
                loop.call_soon_threadsafe(self._sent, connection, fetch, held, seconds)
            except RuntimeError:  # the loop is closed: this replica is stopping
                return
            if held is None:
                return

    async def _send(self, connection: Connection, pair: PairChannel | None, staging: Staging, fetch: Fetch) -> bool:
        """A fetch that came on the connection (a pair that does not carry its fetches): the send, in a
        worker thread."""
        if pair is None:
            log.warning("a fetch of %s from %s before any pair channel", fetch.request_id, connection.peer)
            return False
        start = time.perf_counter()
        try:
            # shielded: once begun, the send completes even if this replica is told to stop, so the
            # pair's two sides never disagree about what was sent
            send = asyncio.to_thread(pair.send_fetched, self.engine.kv_cache, self.engine.kv_generations, fetch,
                                     staging, self.delay_send_s)
            held = (await asyncio.shield(asyncio.wait_for(send, self.timeout_s))).held
        except Exception:
            log.exception("KV send of %s failed", fetch.request_id)
            held = None
        self._sent(connection, fetch, held, time.perf_counter() - start)
        return held is not None

    def _sent(self, connection: Connection, fetch: Fetch | None, held: bool | None, seconds: float) -> None:
        """After a send (`held`: its verdict; None: it failed, or the pair ended before a fetch):
        the blocks are freed — decode has them or recomputes — and a failed pair's connection
        closes, so the peer starts over on a new one."""
        if fetch is not None:
            self.engine.release(fetch.request_id)
        if held is None:
            connection.close()
        elif held:
            kv_bytes = len(fetch.source_block_ids) * block_bytes(self.engine.kv_cache)
            self.ledger.record([KvSent(c, self.pair_transport, kv_bytes, seconds, self.name, connection.peer)
                                for c in fetch.choice_ids])

    def _copied(self, connection: Connection, copied: Copied) -> None:
        """A decode replica is done with a lease: it copied the blocks out of the shared cache itself
        (this node) or out of what was pushed to it, or will not read them."""
        self.engine.release(copied.request_id)
        if (pusher := self._pushers.get(connection)) is not None:
            pusher.claimed(copied.request_id)
        if copied.held:
            self.ledger.record([KvSent(c, copied.transport, copied.kv_bytes, copied.seconds, self.name,
                                       connection.peer) for c in copied.choice_ids])

    async def _release(self, request_id: str) -> None:
        """Free a lease now; one that is not parked yet (still being prefilled) is freed when it
        parks, so an ingress that gave up mid-prefill leaks nothing until the lease's expiry."""
        if not await self.engine.call(commands.ReleaseRequest(request_id)):
            now = time.monotonic()
            self._tombstones = {r: t for r, t in self._tombstones.items() if t > now}
            self._tombstones[request_id] = now + TOMBSTONE_S

    def close(self) -> None:
        self._listener.close()


