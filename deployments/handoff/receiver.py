"""The decode side of the handoff: claim a prompt's KV from the prefill replica that holds it and
write it into the blocks this replica's engine reserved (only the blocks after the prompt's prefix
already cached here move).

One connection and one pair channel per prefill replica, one transfer at a time on each: the
fetches of a pair are in the same order on both sides. A transfer that fails or times out drops
the connection and the pair (both sides start over), and the request recomputes its prompt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from deployments.channel import Address, Connection, connect
from deployments.handoff.protocol import Fetch, FetchReply, Lease, OpenPair, PairOffer
from deployments.handoff.transports import GlooPair, NcclPair, PairChannel, Staging, kv_from_bytes
from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.engine.runner import unpack_blocks, unpack_layer
from pegaserve.engine.scheduler import ReceiveTarget

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Transfer:
    ok: bool
    reason: str = ""
    kv_bytes: int = 0
    seconds: float = 0.0


@dataclass
class _Peer:
    connection: Connection
    pair: PairChannel | None = None
    staging: Staging = field(default_factory=Staging)


@dataclass
class KvReceiver:
    engine: AsyncEngine
    name: str
    transport: str
    timeout_s: float
    _peers: dict[Address, _Peer] = field(default_factory=dict)
    _locks: dict[Address, asyncio.Lock] = field(default_factory=lambda: defaultdict(asyncio.Lock))
    _generation: int = 0

    async def fetch(self, lease: Lease, target: ReceiveTarget, choice_ids: tuple[str, ...]) -> Transfer:
        """The prompt's missing blocks into `target`, for the choices `choice_ids`. Never raises: a
        failure is a `Transfer` that is not ok (decode recomputes), and it returns only once nothing
        writes into `target` any more (a transfer is never cut half way)."""
        start = time.perf_counter()
        if not target.block_ids:  # every block of the prompt was already in this replica's cache
            return Transfer(True, seconds=time.perf_counter() - start)
        try:
            kv_bytes = await asyncio.wait_for(self._fetch(lease, target, choice_ids), self.timeout_s)
        except Exception as exc:
            log.warning("KV fetch of %s failed (%s: %s); recomputing", lease.request_id, type(exc).__name__, exc)
            return Transfer(False, f"transfer failed: {type(exc).__name__}")
        if kv_bytes is None:
            return Transfer(False, "lease expired or unknown")
        return Transfer(True, kv_bytes=kv_bytes, seconds=time.perf_counter() - start)

    async def _fetch(self, lease: Lease, target: ReceiveTarget, choice_ids: tuple[str, ...]) -> int | None:
        """The KV bytes written into `target`'s blocks, or None when the lease is gone."""
        cache = self.engine.kv_cache
        if lease.kv_ref is not None:
            data = await lease.kv_ref[0]
            packed = kv_from_bytes(data, lease.kv_dtype, lease.kv_shape)[:, :, target.first_block :]
            await asyncio.to_thread(unpack_blocks, cache, target.block_ids, packed)
            return packed.numel() * packed.element_size()
        if self.transport == "object_store":
            return None  # the lease expired before prefill could put the KV in the store
        async with self._locks[lease.address]:  # one transfer per pair at a time
            return await self._pull(lease, Fetch(lease.request_id, target.first_block, choice_ids), target)

    async def _pull(self, lease: Lease, fetch: Fetch, target: ReceiveTarget) -> int | None:
        """Fetch over the pair channel, each layer written into the cache as it arrives."""
        peer = await self._peer(lease)
        cache = self.engine.kv_cache
        try:
            peer.connection.send(fetch)
            reply = await peer.connection.recv()
            if not isinstance(reply, FetchReply):
                raise ConnectionError("the prefill replica closed the connection")
            if not reply.ok:
                return None
            buffer = peer.staging.take(lease.shape_from(target.first_block), getattr(torch, lease.kv_dtype),
                                       cache.device)
            index = torch.tensor(target.block_ids, device=cache.device)
            receive = asyncio.ensure_future(asyncio.to_thread(
                peer.pair.recv_layers, buffer, lambda layer, part: unpack_layer(cache, layer, index, part)))
            try:  # the bytes were announced: the recv completes (or fails on gloo's own timeout) whatever happens
                await asyncio.shield(receive)
            except asyncio.CancelledError:
                await asyncio.wait([receive])  # its thread writes into `target`: never let it outlive the fetch
                raise
            return buffer.numel() * buffer.element_size()
        except BaseException:
            self._drop(lease.address)
            raise

    async def _peer(self, lease: Lease) -> _Peer:
        peer = self._peers.get(lease.address)
        if peer is not None and not peer.connection.closed:
            return peer
        connection = await connect(lease.address, self.name)
        peer = self._peers[lease.address] = _Peer(connection)
        try:
            self._generation += 1
            group = f"pegaserve-kv-{lease.prefill_replica}-{self.name}-{self._generation}"
            connection.send(OpenPair(group))
            offer = await connection.recv()
            if not isinstance(offer, PairOffer):
                raise ConnectionError("the prefill replica did not offer a pair channel")
            if self.transport == "nccl":
                peer.pair = await asyncio.to_thread(NcclPair, group, 1)
            else:
                store = await asyncio.to_thread(GlooPair.join, offer.host, offer.port, self.timeout_s)
                peer.pair = await asyncio.to_thread(GlooPair, store, 1, self.timeout_s)
        except BaseException:
            self._drop(lease.address)
            raise
        return peer

    def _drop(self, address: Address) -> None:
        peer = self._peers.pop(address, None)
        if peer is not None:
            peer.connection.close()

