"""The decode side of the handoff: claim a prompt's KV from the prefill replica that holds it and
write it into the blocks this replica's engine reserved (only the blocks after the prompt's prefix
already cached here move).

One connection per prefill replica. With `shm` and both replicas on one node, decode maps the
prefill engine's KV cache (a file in shared memory), copies the blocks itself, checks them against
their generations and tells prefill it may free them — no round trip. Otherwise the bytes travel
over the connection's pair channel (gloo, nccl), one transfer at a time, the fetches of a pair in
the same order on both sides (on gloo the fetch itself goes on the pair), unless prefill pushed
them before decode asked: then decode copies them out of what landed (handoff/push.py). A
transfer that fails or times out drops the connection and the pair (both sides start over), and
the request recomputes its prompt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import ray
import torch
from pegaserve.deployments.channel import Address, Connection, connect
from pegaserve.deployments.handoff import native
from pegaserve.deployments.handoff.protocol import Copied, Fetch, Lease, OpenPair, PairOffer, SharedCache
from pegaserve.deployments.handoff.push import Inbox
from pegaserve.deployments.handoff.transports import GlooPair, NcclPair, PairChannel, Staging, kv_from_bytes

from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.kv.files import MappedKvFiles
from pegaserve.request import ReceiveTarget
from pegaserve.runner.model_runner import copy_blocks, unpack_blocks

log = logging.getLogger("ray.serve")
MAX_MAPPED_CACHES = 8  # prefill caches kept mapped (one per prefill replica of this node)
# The engine copies a prompt's KV between steps up to this size (~0.7 ms at 8 MiB); a bigger prompt
# is copied here, beside the engine, at the price of one more wait for a step boundary.
ENGINE_COPY_MAX_BYTES = 16 << 20


@dataclass(frozen=True)
class Transfer:
    ok: bool
    transport: str  # what moved the bytes: shm, gloo, nccl or object_store
    reason: str = ""
    kv_bytes: int = 0
    seconds: float = 0.0
    pushed: bool = False  # prefill sent the bytes before they were asked for (handoff/push.py)


@dataclass
class _Peer:
    connection: Connection
    pair: PairChannel | None = None  # opened on the first transfer that needs one
    group_name: str = ""  # the pair's
    inbox: Inbox | None = None  # what prefill pushes on the pair (gloo)
    staging: Staging = field(default_factory=Staging)


@dataclass
class KvReceiver:
    engine: AsyncEngine
    name: str
    transport: str
    timeout_s: float
    _peers: dict[Address, _Peer] = field(default_factory=dict)
    _locks: dict[Address, asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))
    _mapped: MappedKvFiles = field(default_factory=lambda: MappedKvFiles(MAX_MAPPED_CACHES))
    _generation: int = 0

    def __post_init__(self) -> None:
        if self.transport in ("gloo", "shm"):  # pairs run on gloo
            native.warm_up()

    def transport_for(self, lease: Lease) -> str:
        if lease.kv_ref is not None or self.transport == "object_store":
            return "object_store"
        if self.transport == "shm" and lease.shared is not None and self._same_node(lease.shared):
            return "shm"
        return "nccl" if self.transport == "nccl" else "gloo"

    async def fetch(self, lease: Lease, target: ReceiveTarget, choice_ids: tuple[str, ...]) -> Transfer:
        """The prompt's missing blocks into `target`, for the choices `choice_ids`. Never raises: a
        failure is a `Transfer` that is not ok (decode recomputes), and it returns only once nothing
        writes into `target` any more (a transfer is never cut half way). Either way the prefill
        replica learns that it may free the lease: from the transfer itself, or told."""
        start = time.perf_counter()
        transport = self.transport_for(lease)
        pushed_on = self._pushed_here(lease) if transport == "gloo" else None
        if not target.block_ids:  # every block of the prompt was already in this replica's cache
            self.release(lease)
            return Transfer(True, transport, seconds=time.perf_counter() - start)
        try:
            async with asyncio.timeout(self.timeout_s):  # (not wait_for: its task costs a turn of the loop)
                kv_bytes = await self._fetch(lease, target, choice_ids, transport, pushed_on)
        except Exception as exc:
            log.warning("KV fetch of %s failed (%s: %s); recomputing", lease.request_id, type(exc).__name__, exc)
            self.release(lease)
            return Transfer(False, transport, f"transfer failed: {type(exc).__name__}")
        if kv_bytes is None:
            return Transfer(False, transport, "lease expired or unknown")
        return Transfer(True, transport, kv_bytes=kv_bytes, seconds=time.perf_counter() - start,
                        pushed=pushed_on is not None)

    async def _fetch(self, lease: Lease, target: ReceiveTarget, choice_ids: tuple[str, ...],
                     transport: str, pushed_on: _Peer | None = None) -> int | None:
        """The KV bytes written into `target`'s blocks (copied out of what was pushed on
        `pushed_on`'s pair, if it was), or None when the lease is gone."""
        if transport == "object_store":
            if lease.kv_ref is None:
                return None  # the lease expired before prefill could put the KV in the store
            data = await lease.kv_ref[0]
            packed = kv_from_bytes(data, lease.kv_dtype, lease.kv_shape)[:, :, target.first_block :]
            await _to_the_end(asyncio.to_thread(unpack_blocks, self.engine.kv_cache, target.block_ids, packed))
            return packed.numel() * packed.element_size()
        source = lease.parked.block_ids[target.first_block :]
        if len(source) != len(target.block_ids):
            raise ValueError(f"{len(source)} blocks leased, {len(target.block_ids)} to fill")
        if transport == "shm":
            return await self._copy_shared(lease, source, target, choice_ids)
        if pushed_on is not None:
            try:
                return await self._claim(pushed_on, lease, target, choice_ids)
            except BaseException:
                self._drop(lease.address)
                raise
        fetch = Fetch(lease.request_id, choice_ids, lease.parked, source, tuple(target.block_ids))
        async with self._locks[lease.address]:  # one transfer per connection at a time
            peer = await self._peer(lease)
            try:
                return await self._pull(peer, fetch, lease)
            except BaseException:
                self._drop(lease.address)
                raise

    def _pushed_here(self, lease: Lease) -> _Peer | None:
        """The peer whose pair the lease's KV is pushed on, if it is this replica's (handoff/push.py)."""
        peer = self._peers.get(lease.address)
        if lease.pushed_to is None or peer is None or peer.inbox is None or peer.group_name != lease.pushed_to:
            return None
        return peer

    async def _claim(self, peer: _Peer, lease: Lease, target: ReceiveTarget, choice_ids: tuple[str, ...]) -> int | None:
        """The pushed KV (once landed) into `target`'s blocks; None (recompute) unless prefill's read
        of it held. Prefill only hears that it may free the blocks (at once: a fetch under way on
        the connection does not hold it up)."""
        start = time.perf_counter()
        data = await peer.inbox.claim(lease.request_id, self.timeout_s)
        cache = self.engine.kv_cache
        kv_bytes = len(target.block_ids) * lease.block_bytes
        if data is not None:
            if not lease.fits(tuple(cache.shape), str(data.dtype).removeprefix("torch.")):
                raise ValueError(f"the pushed KV ({data.dtype} {tuple(data.shape)}) does not fit this cache")
            await _to_the_end(asyncio.to_thread(copy_blocks, data, list(range(target.first_block, data.shape[2])),
                                                cache, list(target.block_ids)))
            peer.inbox.recycle(data)
        peer.connection.send(Copied(lease.request_id, choice_ids, kv_bytes, time.perf_counter() - start,
                                    data is not None, "gloo"))
        return kv_bytes if data is not None else None

    async def _copy_shared(self, lease: Lease, source: tuple[int, ...], target: ReceiveTarget,
                           choice_ids: tuple[str, ...]) -> int | None:
        """Copy the blocks straight out of the prefill engine's cache; None (recompute) unless they
        were the prompt's throughout. Prefill only hears that it may free them."""
        start = time.perf_counter()
        blocks, generations = self._map(lease.shared)
        await _to_the_end(asyncio.to_thread(copy_blocks, blocks, list(source), self.engine.kv_cache,
                                            list(target.block_ids)))
        held = lease.parked.intact(source, generations, time.monotonic())  # one node: the engine's clock is ours
        kv_bytes = len(source) * lease.block_bytes
        await self.copied(lease, choice_ids, kv_bytes, time.perf_counter() - start, held)
        return kv_bytes if held else None

    def copies_in_engine(self, lease: Lease) -> bool:
        """Whether this replica's engine should copy the prompt's KV itself, between two steps
        (`AddSharedHandoff`): shm on one node, and few enough bytes not to hold up its next step."""
        num_bytes = len(lease.parked.block_ids) * lease.block_bytes
        return self.transport_for(lease) == "shm" and num_bytes <= ENGINE_COPY_MAX_BYTES

    async def copied(self, lease: Lease, choice_ids: tuple[str, ...], kv_bytes: int, seconds: float,
                     held: bool) -> None:
        """Tell the prefill replica its blocks were read (or read too late): it may free them. If it
        cannot be told (gone), its lease runs out on its own."""
        try:
            async with self._locks[lease.address]:
                peer = await self._peer(lease)
        except (OSError, asyncio.TimeoutError) as exc:
            log.warning("cannot tell %s that %s was copied (%s)", lease.prefill_replica, lease.request_id, exc)
            return
        peer.connection.send(Copied(lease.request_id, choice_ids, kv_bytes, seconds, held))

    def release(self, lease: Lease) -> None:
        """Tell the prefill replica, in the background, that this replica will not read the lease's
        blocks (it has them all cached, or recomputes): it frees them now, not at the lease's
        expiry. The ingress leaves a lease to the decode call that carried it (deployments/clients.py)."""
        if self.transport_for(lease) != "object_store":  # (that KV left the prefill engine at lease time)
            if (peer := self._pushed_here(lease)) is not None:
                peer.inbox.drop(lease.request_id)
            asyncio.ensure_future(self.copied(lease, (), 0, 0.0, held=False))

    async def _pull(self, peer: _Peer, fetch: Fetch, lease: Lease) -> int | None:
        """Post the receives straight into the target blocks, then ask for the bytes; the sender's
        verdict on them comes last."""
        cache = self.engine.kv_cache
        if not lease.fits(tuple(cache.shape), str(cache.dtype).removeprefix("torch.")):
            raise ValueError(f"the prompt's KV ({lease.kv_dtype} {lease.kv_shape}) does not fit this cache")
        await self._open_pair(peer, lease)
        pair = peer.pair
        if pair.carries_fetches:  # straight to the sender's thread for this pair
            finish = pair.pull(cache, fetch, peer.staging)
        else:
            finish = pair.start_recv(cache, fetch.source_block_ids, fetch.target_block_ids, peer.staging)
            peer.connection.send(fetch)
        held = await _to_the_end(asyncio.to_thread(finish))
        return len(fetch.source_block_ids) * lease.block_bytes if held else None

    def _same_node(self, shared: SharedCache) -> bool:
        return shared.node_id == ray.get_runtime_context().get_node_id()

    def _map(self, shared: SharedCache) -> tuple[torch.Tensor, Sequence[int]]:
        """The prefill engine's cache and its blocks' generations."""
        return self._mapped.get(shared.path, shared.shape, self.engine.kv_cache.dtype)

    async def _peer(self, lease: Lease) -> _Peer:
        peer = self._peers.get(lease.address)
        if peer is not None and not peer.connection.closed:
            return peer
        peer = self._peers[lease.address] = _Peer(await connect(lease.address, self.name))
        return peer

    async def _open_pair(self, peer: _Peer, lease: Lease) -> None:
        if peer.pair is not None:
            return
        self._generation += 1
        group = f"pegaserve-kv-{lease.prefill_replica}-{self.name}-{self._generation}"
        peer.connection.send(OpenPair(group))
        offer = await peer.connection.recv()
        if not isinstance(offer, PairOffer):
            raise ConnectionError("the prefill replica did not offer a pair channel")
        peer.group_name = group
        if self.transport == "nccl":
            peer.pair = await asyncio.to_thread(NcclPair, group, 1)
        else:
            store = await asyncio.to_thread(GlooPair.join, offer.host, offer.port, self.timeout_s)
            peer.pair = await asyncio.to_thread(GlooPair, store, 1, self.timeout_s)
            peer.inbox = Inbox(asyncio.get_running_loop())
            peer.inbox.start(peer.pair, self.name)

    def close(self) -> None:
        """Leave every prefill replica: connections and pairs close (an inbox ends with its pair)."""
        for address in list(self._peers):
            self._drop(address)

    def _drop(self, address: Address) -> None:
        peer = self._peers.pop(address, None)
        if peer is not None:
            peer.connection.close()
            if peer.pair is not None:
                peer.pair.close()


async def _to_the_end(copy):
    """The result of `copy` — into this replica's cache — awaited to its end even when cancelled
    meanwhile: its thread writes into blocks the engine reserved, so it must never outlive the fetch."""
    task = asyncio.ensure_future(copy)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise
