"""The decode deployment: claim the prompt's KV from the prefill replica that holds it, continue
after the first token (never re-sampling it), stream one message per engine step."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator

import torch
from ray import serve

from deployments.common import build_engine, ledger_actor, replica_name, report_stats_forever
from deployments.config import AppArgs
from deployments.kv import Fetch, FetchReply, Lease, PortDirectory, kv_from_bytes
from deployments.metrics import EngineMetrics, TransferMetrics
from deployments.transport import PairChannel, open_pair
from pegaserve.engine.async_engine import in_chunks
from pegaserve.engine.engine import Role
from pegaserve.engine.request import EngineRequest, Handoff, SampledToken, StepOutput
from pegaserve.ledger import Fallback, KvReceived

log = logging.getLogger("ray.serve")


@serve.deployment(name="Decode")
class DecodeServer:
    async def __init__(self, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.engine = build_engine(self.args, Role.DECODE)
        self.name = replica_name()
        self.ledger = ledger_actor(self.args)
        self.pairs: dict[str, PairChannel] = {}  # prefill replica -> open channel
        self.generation: dict[str, int] = defaultdict(int)  # bumped when a channel fails
        self.peer_locks: dict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        self.ports = PortDirectory()
        self.transfers = TransferMetrics(self.args.model, "Decode")
        metrics = EngineMetrics(self.args.model, "Decode", self.name)
        self._stats_task = asyncio.create_task(report_stats_forever(self.engine, self.ledger, metrics, self.name, "decode"))

    async def generate(self, spec: EngineRequest, first_token: SampledToken, lease: Lease) -> AsyncIterator[StepOutput]:
        kv = await self._claim(lease)
        imported, outputs = await self.engine.continue_handoff(Handoff(spec, first_token, kv))
        if kv is not None and not imported:
            self.transfers.fallback(self.args.transport)
            self.ledger.record.remote([Fallback(spec.request_id, "no free blocks to import", self.name)], self.name)
        async for output in in_chunks(outputs, self.args.stream_interval):
            yield output

    async def _claim(self, lease: Lease) -> torch.Tensor | None:
        """The prompt's KV from its prefill replica, or None (decode then recomputes the prompt)."""
        start = time.perf_counter()
        try:
            kv = await asyncio.wait_for(self._fetch(lease), self.args.transfer_timeout_s)
        except Exception as exc:  # a failed transfer costs a recompute, never the request
            log.warning("KV fetch for %s failed (%s); recomputing", lease.request_id, exc)
            kv, reason = None, f"transfer failed: {type(exc).__name__}: {exc}"
        else:
            reason = "lease expired or unknown" if kv is None else ""
        if kv is None:
            self.transfers.fallback(self.args.transport)
            self.ledger.record.remote([Fallback(lease.request_id, reason, self.name)], self.name)
            return None
        seconds = time.perf_counter() - start
        kv_bytes = kv.numel() * kv.element_size()
        self.transfers.transferred(self.args.transport, kv_bytes, seconds)
        self.ledger.record.remote([KvReceived(lease.request_id, self.args.transport, kv_bytes, seconds, self.name)],
                                  self.name)
        return kv

    async def _fetch(self, lease: Lease) -> torch.Tensor | None:
        port = await self.ports.get(lease.port_name)
        peer = lease.prefill_replica
        async with self.peer_locks[peer]:  # one transfer per pair at a time: both sides agree on order
            group = f"{peer}-{self.name}-{self.generation[peer]}"
            try:
                reply: FetchReply = await port.call.remote(Fetch(lease.request_id, self.name, group))
                if not reply.ok:
                    return None
                if reply.kv_ref is not None:
                    return kv_from_bytes(await reply.kv_ref[0], lease).to(self.args.engine.device)
                buffer = torch.empty(lease.kv_shape, dtype=getattr(torch, lease.kv_dtype),
                                     device=self.args.engine.device)
                pair = self.pairs.get(peer)
                if pair is None:
                    timeout = self.args.transfer_timeout_s
                    pair = await asyncio.to_thread(open_pair, self.args.transport, group, 1, timeout)
                    self.pairs[peer] = pair
                await asyncio.to_thread(pair.recv, buffer)
                return buffer
            except BaseException:
                self.pairs.pop(peer, None)
                self.generation[peer] += 1  # both sides move to a fresh group
                raise

    def __del__(self) -> None:
        self.engine.shutdown()
