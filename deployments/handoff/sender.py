"""The prefill side of the handoff: a KV server that decode replicas (fetches, copies done) and
ingress replicas (releases) connect to directly.

Leases are the engine's parked requests: the engine keeps their blocks until a release or the
lease's expiry; this server keeps no table of its own. Each connection's messages are served
strictly in order, so a pair channel's sends happen in the order its receiver expects; a gloo pair
carries its fetches itself, to a thread of its own that sends the moment one arrives. The blocks
are read straight from the KV cache the engine process shares with this replica, and checked
against their generations once read — the engine loop is neither asked to copy nor to confirm.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import ray
import torch
from pegaserve.deployments.channel import Address, Connection, Listener
from pegaserve.deployments.handoff import native
from pegaserve.deployments.handoff.protocol import (
    Copied,
    Fetch,
    Lease,
    OpenPair,
    PairOffer,
    ReleaseLease,
    SharedCache,
)
from pegaserve.deployments.handoff.push import Pusher
from pegaserve.deployments.handoff.transports import (
    MAX_FETCH_BYTES,
    GlooPair,
    NcclPair,
    PairChannel,
    Staging,
    block_bytes,
    fetch_in,
    kv_as_bytes,
    packed_shape,
)

from pegaserve.engine import commands
from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.ledger import KvSent
from pegaserve.request import EngineRequest, ParkedKv, StepOutput
from pegaserve.runner.model_runner import pack_blocks

log = logging.getLogger("ray.serve")
TOMBSTONE_S = 120.0


class KvSender:
    def __init__(self, engine: AsyncEngine, name: str, transport: str, timeout_s: float, ledger,
                 delay_send_s: float = 0.0, push: bool = True) -> None:
        self.engine = engine
        self.name = name
        self.transport = transport
        self.timeout_s = timeout_s
        self.ledger = ledger
        self.delay_send_s = delay_send_s  # a test double's fault: hold every send back this long
        self._listener = Listener(self._serve)
        self._tombstones: dict[str, float] = {}  # released before they parked -> until when to remember
        self.push = push and transport == "gloo"  # push each lease's KV where it can (handoff/push.py)
        self._pushers: dict[Connection, Pusher] = {}  # the gloo pairs open, by their connection
        self.num_pairs = 0
        if transport in ("gloo", "shm"):  # pairs run on gloo
            native.warm_up()

    async def start(self) -> Address:
        return await self._listener.start()

    @property
    def pair_transport(self) -> str:
        """What a pair channel runs on: nccl, or gloo (shm's way across nodes)."""
        return "nccl" if self.transport == "nccl" else "gloo"

    @property
    def serving(self) -> bool:
        return self._listener.serving

    @property
    def address(self) -> Address:
        assert self._listener.address is not None, "start() first"
        return self._listener.address

    async def lease(self, request: EngineRequest, outputs: list[StepOutput]) -> Lease:
        """The lease of a parked request (`outputs`: its choices' first outputs, which say where the
        prompt's KV is parked). With the object store, its KV goes there now and the blocks are
        freed at once; otherwise they stay parked until a fetch sends them (or the lease expires:
        then the fetch's bytes are turned away and decode recomputes)."""
        if self._tombstones.pop(request.request_id, None) is not None:
            self.engine.release(request.request_id)  # its ingress gave up while it was being prefilled
        cache = self.engine.kv_cache
        parked = next(o.parked for o in outputs if o.parked is not None)
        kv_ref = None
        if self.transport == "object_store":
            packed = await asyncio.to_thread(pack_blocks, cache, parked.block_ids)
            if parked.intact(parked.block_ids, self.engine.kv_generations, time.monotonic()):
                kv_ref = [ray.put(kv_as_bytes(packed))]
            self.engine.release(request.request_id)
        shared = None
        if self.transport == "shm" and self.engine.kv_path is not None:
            shared = SharedCache(ray.get_runtime_context().get_node_id(), self.engine.kv_path, tuple(cache.shape))
        pushed_to = self._push(request.request_id, parked, len(parked.block_ids) * block_bytes(cache))
        return Lease(request.request_id, self.name, self.address, packed_shape(cache, len(parked.block_ids)),
                     str(cache.dtype).removeprefix("torch."), block_bytes(cache), parked, kv_ref, shared, pushed_to)

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
        if self.transport == "nccl":
            connection.send(PairOffer("", 0))
            pair = await asyncio.to_thread(NcclPair, group_name, 0)
        else:
            store = await asyncio.to_thread(GlooPair.offer, self.timeout_s)
            connection.send(PairOffer(ray.util.get_node_ip_address(), store.port))
            pair = await asyncio.wait_for(asyncio.to_thread(GlooPair, store, 0, self.timeout_s), self.timeout_s)
        self.num_pairs += 1
        if isinstance(pair, GlooPair):
            self._pushers[connection] = Pusher(pair, group_name)
        if pair.carries_fetches:
            threading.Thread(target=self._serve_pair, args=(pair, connection, asyncio.get_running_loop()),
                             name=f"pegaserve-kv-pair-{self.num_pairs}", daemon=True).start()
        return pair

    def _serve_pair(self, pair: PairChannel, connection: Connection, loop: asyncio.AbstractEventLoop) -> None:
        """The thread of a pair that carries its own fetches (gloo): it waits for the next one and
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
        """A fetch that came on the connection (nccl): the send, in a worker thread."""
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


