"""The decode side of the handoff: claim a prompt's KV from the prefill replica that holds it and
write it into the blocks this replica's engine reserved (only the blocks after the prompt's prefix
already cached here move).

The lease's transport (`KvTransport.route`) moves the bytes: one that reads them itself (from the
prefill engine's cache in shared memory, from a store) tells prefill it may free them, with no
round trip; otherwise they travel over a pair channel to the prefill replica (one connection per
prefill replica, its pair opened on the first transfer), one transfer at a time, the fetches of a
pair in the same order on both sides, unless prefill pushed them before decode asked: then decode
copies them out of what landed (pd/push.py). A transfer that fails or times out drops the
connection and the pair (both sides start over), and the request recomputes its prompt.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.messages import ReceiveTarget
from pegaserve.net.channel import Address, Connection, connect
from pegaserve.net.node import NodeInfo
from pegaserve.pd.pair_channel import PairChannel, Staging
from pegaserve.pd.protocol import Copied, Fetch, Lease, OpenPair, PairOffer
from pegaserve.pd.push import Inbox
from pegaserve.pd.transports.base import KvTransport, PairTransport, source_blocks, to_the_end
from pegaserve.pd.transports.registry import make_transport
from pegaserve.runner.model_runner import copy_blocks

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class Transfer:
    ok: bool
    transport: str  # the name of the transport that moved the bytes (`KvTransport.name`)
    reason: str = ""
    kv_bytes: int = 0
    seconds: float = 0.0
    pushed: bool = False  # prefill sent the bytes before they were asked for (pd/push.py)


@dataclass
class _Peer:
    connection: Connection
    pair: PairChannel | None = None  # opened on the first transfer that needs one
    group_name: str = ""  # the pair's
    inbox: Inbox | None = None  # what prefill pushes on the pair (if its pairs carry pushes)
    staging: Staging = field(default_factory=Staging)


class KvReceiver:
    """`transport`: the registry's name of it (pd/transports/registry.py); `node`: where this
    replica runs (which prefill replicas share its machine)."""

    def __init__(self, engine: AsyncEngine, name: str, transport: str, timeout_s: float, *, node: NodeInfo) -> None:
        self.engine = engine
        self.name = name
        self.transport = make_transport(transport, node)
        self.timeout_s = timeout_s
        self._peers: dict[Address, _Peer] = {}
        self._locks: dict[Address, asyncio.Lock] = defaultdict(asyncio.Lock)
        self._generation = 0
        self.transport.warm_up()

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.engine.kv_cache

    def route(self, lease: Lease) -> KvTransport:
        """The transport that moves this lease's bytes."""
        return self.transport.route(lease)

    def transport_for(self, lease: Lease) -> str:
        return self.route(lease).name

    async def fetch(self, lease: Lease, target: ReceiveTarget, choice_ids: tuple[str, ...]) -> Transfer:
        """The prompt's missing blocks into `target`, for the choices `choice_ids`. Never raises: a
        failure is a `Transfer` that is not ok (decode recomputes), and it returns only once nothing
        writes into `target` any more (a transfer is never cut half way). Either way the prefill
        replica learns that it may free the lease: from the transfer itself, or told."""
        start = time.perf_counter()
        route = self.route(lease)
        transport = route.name
        pushed_on = self._pushed_here(lease) if isinstance(route, PairTransport) else None
        if not target.block_ids:  # every block of the prompt was already in this replica's cache
            self.release(lease)
            return Transfer(True, transport, seconds=time.perf_counter() - start)
        try:
            async with asyncio.timeout(self.timeout_s):  # (not wait_for: its task costs a turn of the loop)
                kv_bytes = await self._fetch(lease, target, choice_ids, route, pushed_on)
        except Exception as exc:
            log.warning("KV fetch of %s failed (%s: %s); recomputing", lease.request_id, type(exc).__name__, exc)
            self.release(lease)
            return Transfer(False, transport, f"transfer failed: {type(exc).__name__}")
        if kv_bytes is None:
            return Transfer(False, transport, "lease expired or unknown")
        return Transfer(True, transport, kv_bytes=kv_bytes, seconds=time.perf_counter() - start,
                        pushed=pushed_on is not None)

    async def _fetch(self, lease: Lease, target: ReceiveTarget, choice_ids: tuple[str, ...],
                     route: KvTransport, pushed_on: _Peer | None = None) -> int | None:
        """The KV bytes written into `target`'s blocks (copied out of what was pushed on
        `pushed_on`'s pair, if it was), or None when the lease is gone."""
        if pushed_on is None:
            return await route.receive(self, lease, target, choice_ids)
        source_blocks(lease, target)  # (the counts must agree whichever way the bytes came)
        try:
            return await self._claim(pushed_on, lease, target, choice_ids)
        except BaseException:
            self._drop(lease.address)
            raise

    async def pull(self, pairs: PairTransport, lease: Lease, target: ReceiveTarget,
                   choice_ids: tuple[str, ...]) -> int | None:
        """The blocks on the pair channel (of `pairs`) to the lease's prefill replica."""
        fetch = Fetch(lease.request_id, choice_ids, lease.parked, source_blocks(lease, target), tuple(target.block_ids))
        async with self._locks[lease.address]:  # one transfer per connection at a time
            peer = await self._peer(lease)
            try:
                return await self._pull(pairs, peer, fetch, lease)
            except BaseException:
                self._drop(lease.address)
                raise

    def _pushed_here(self, lease: Lease) -> _Peer | None:
        """The peer whose pair the lease's KV is pushed on, if it is this replica's (pd/push.py)."""
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
            await to_the_end(asyncio.to_thread(copy_blocks, data, list(range(target.first_block, data.shape[2])),
                                               cache, list(target.block_ids)))
            peer.inbox.recycle(data)
        peer.connection.send(Copied(lease.request_id, choice_ids, kv_bytes, time.perf_counter() - start,
                                    data is not None, self.transport_for(lease)))
        return kv_bytes if data is not None else None

    def copies_in_engine(self, lease: Lease) -> bool:
        """Whether this replica's engine should copy the prompt's KV itself, between two steps
        (`AddSharedHandoff`: from the prefill engine's cache on this node), as the lease's transport says."""
        return self.route(lease).copies_in_engine(lease)

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
        peer.connection.send(Copied(lease.request_id, choice_ids, kv_bytes, seconds, held, self.transport_for(lease)))

    def release(self, lease: Lease) -> None:
        """Tell the prefill replica, in the background, that this replica will not read the lease's
        blocks (it has them all cached, or recomputes): it frees them now, not at the lease's
        expiry. The ingress leaves a lease to the decode call that carried it (deployments/orchestration.py)."""
        if not self.route(lease).frees_at_lease:
            if (peer := self._pushed_here(lease)) is not None:
                peer.inbox.drop(lease.request_id)
            asyncio.ensure_future(self.copied(lease, (), 0, 0.0, held=False))

    async def _pull(self, pairs: PairTransport, peer: _Peer, fetch: Fetch, lease: Lease) -> int | None:
        """Post the receives straight into the target blocks, then ask for the bytes; the sender's
        verdict on them comes last."""
        cache = self.engine.kv_cache
        if not lease.fits(tuple(cache.shape), str(cache.dtype).removeprefix("torch.")):
            raise ValueError(f"the prompt's KV ({lease.kv_dtype} {lease.kv_shape}) does not fit this cache")
        await self._open_pair(pairs, peer, lease)
        pair = peer.pair
        if pair.carries_fetches:  # straight to the sender's thread for this pair
            finish = pair.pull(cache, fetch, peer.staging)
        else:
            finish = pair.start_recv(cache, fetch.source_block_ids, fetch.target_block_ids, peer.staging)
            peer.connection.send(fetch)
        held = await to_the_end(asyncio.to_thread(finish))
        return len(fetch.source_block_ids) * lease.block_bytes if held else None

    async def _peer(self, lease: Lease) -> _Peer:
        peer = self._peers.get(lease.address)
        if peer is not None and not peer.connection.closed:
            return peer
        peer = self._peers[lease.address] = _Peer(await connect(lease.address, self.name))
        return peer

    async def _open_pair(self, pairs: PairTransport, peer: _Peer, lease: Lease) -> None:
        if peer.pair is not None:
            return
        self._generation += 1
        group = f"pegaserve-kv-{lease.prefill_replica}-{self.name}-{self._generation}"
        peer.connection.send(OpenPair(group))
        offer = await peer.connection.recv()
        if not isinstance(offer, PairOffer):
            raise ConnectionError("the prefill replica did not offer a pair channel")
        peer.group_name = group
        peer.pair = await pairs.join_pair(offer, group, self.timeout_s)
        if pairs.pushable:
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

