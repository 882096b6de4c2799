"""`shm`: between replicas of one node, decode maps the prefill engine's KV cache (a file in shared
memory, pegaserve/kv/files.py), copies the prompt's blocks itself, checks them against their
generations and tells prefill it may free them — no round trip, no pair. A prompt of a few MiB is
copied by decode's engine itself as it admits the request (`copies_in_engine`: `AddSharedHandoff`,
one step boundary); a bigger one beside the engine, at the price of one more wait for a boundary.
Across nodes the KV goes over gloo (its transfers are recorded as gloo's).
"""

from __future__ import annotations

import asyncio
import time

from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.kv.files import MappedKvFiles
from pegaserve.messages import ParkedKv, ReceiveTarget
from pegaserve.net.node import NodeInfo
from pegaserve.pd.protocol import Lease, SharedCache
from pegaserve.pd.transports.base import KvTransport, LeaseKv, Receiving, source_blocks, to_the_end
from pegaserve.pd.transports.gloo import GlooTransport
from pegaserve.runner.model_runner import copy_blocks

MAX_MAPPED_CACHES = 8  # prefill caches kept mapped (one per prefill replica of this node)
# The engine copies a prompt's KV between steps up to this size (~0.7 ms at 8 MiB); a bigger prompt
# is copied beside the engine, at the price of one more wait for a step boundary.
ENGINE_COPY_MAX_BYTES = 16 << 20


class ShmTransport(KvTransport):
    name = "shm"
    summary = "shared memory between replicas of one node, gloo across nodes"

    def __init__(self, node: NodeInfo) -> None:
        super().__init__(node)
        self._across_nodes = GlooTransport(node)
        self._mapped = MappedKvFiles(MAX_MAPPED_CACHES)

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, self._across_nodes.name)

    @property
    def pairs(self) -> GlooTransport:
        return self._across_nodes

    def warm_up(self) -> None:
        self._across_nodes.warm_up()

    async def lease_kv(self, engine: AsyncEngine, request_id: str, parked: ParkedKv) -> LeaseKv:
        if engine.kv_path is None:  # the cache is private to the engine's process: gloo it is
            return LeaseKv()
        return LeaseKv(shared=SharedCache(self.node.node_id, engine.kv_path, tuple(engine.kv_cache.shape)))

    def route(self, lease: Lease) -> KvTransport:
        same_node = lease.shared is not None and lease.shared.node_id == self.node.node_id
        return self if same_node else self._across_nodes

    def copies_in_engine(self, lease: Lease) -> bool:
        """Few enough bytes not to hold up the engine's next step."""
        return len(lease.parked.block_ids) * lease.block_bytes <= ENGINE_COPY_MAX_BYTES

    async def receive(self, receiver: Receiving, lease: Lease, target: ReceiveTarget,
                      choice_ids: tuple[str, ...]) -> int | None:
        """Copy the blocks straight out of the prefill engine's cache; None (recompute) unless they
        were the prompt's throughout. Prefill only hears that it may free them."""
        source = source_blocks(lease, target)
        start = time.perf_counter()
        blocks, generations = self._mapped.get(lease.shared.path, lease.shared.shape, receiver.kv_cache.dtype)
        await to_the_end(asyncio.to_thread(copy_blocks, blocks, list(source), receiver.kv_cache,
                                           list(target.block_ids)))
        held = lease.parked.intact(source, generations, time.monotonic())  # one node: the engine's clock is ours
        kv_bytes = len(source) * lease.block_bytes
        await receiver.copied(lease, choice_ids, kv_bytes, time.perf_counter() - start, held)
        return kv_bytes if held else None
