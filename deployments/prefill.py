"""The prefill deployment: prompt forward, first token sampled and classified, KV kept under a
lease and sent to whichever decode replica claims it (docs/CONTRACT.md rules 21-22)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import ray
from ray import serve

from deployments.common import build_engine, ledger_actor, replica_name, report_stats_forever
from deployments.config import AppArgs
from deployments.kv import PORT_NAMESPACE, kv_as_bytes, Fetch, FetchReply, KvPort, Lease, Release, port_name
from deployments.metrics import EngineMetrics
from deployments.transport import PairChannel, open_pair
from pegaserve.engine.engine import Role
from pegaserve.engine.request import EngineRequest, StepOutput
from pegaserve.ledger import KvSent, Prefilled

log = logging.getLogger("ray.serve")
LEASE_CHECK_PERIOD_S = 0.5


@dataclass(frozen=True)
class PrefillResult:
    output: StepOutput  # the first token, and its finish if it is terminal
    replica: str
    lease: Lease | None  # None: terminal first token, nothing to move


@serve.deployment(name="Prefill")
class PrefillServer:
    async def __init__(self, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.engine = build_engine(self.args, Role.PREFILL)
        self.name = replica_name()
        self.port_name = port_name(self.name)
        self.port = KvPort.options(name=self.port_name, namespace=PORT_NAMESPACE).remote()
        self.ledger = ledger_actor(self.args)
        self.leases: dict[str, float] = {}  # request_id -> expiry (monotonic seconds)
        self.pairs: dict[str, PairChannel] = {}  # group name -> open channel
        self.peers: dict[str, asyncio.Queue] = {}  # decode replica -> its fetches, in order
        metrics = EngineMetrics(self.args.model, "Prefill", self.name)
        self._tasks = [
            asyncio.create_task(self._drain_port()),
            asyncio.create_task(self._expire_leases()),
            asyncio.create_task(report_stats_forever(
                self.engine, self.ledger, metrics, self.name, "prefill", lambda: {"num_leases": len(self.leases)})),
        ]

    async def prefill(self, spec: EngineRequest) -> PrefillResult:
        output = await self.engine.prefill(spec)
        first = output.tokens[0]
        self.ledger.record.remote([Prefilled(spec.request_id, first.token_id, first.logprob, self.name)], self.name)
        if output.finish is not None:
            return PrefillResult(output, self.name, None)
        kv_shape = await self.engine.call(lambda e: e.export_shape(spec.request_id))
        self.leases[spec.request_id] = time.monotonic() + self.args.lease_timeout_s
        dtype = str(self.engine.engine.kv_dtype).removeprefix("torch.")
        lease = Lease(spec.request_id, self.name, self.port_name, kv_shape, dtype)
        return PrefillResult(output, self.name, lease)

    # --- the port: fetches from decode, releases from the ingress --------------------------------

    async def _drain_port(self) -> None:
        while True:
            try:
                key, message = await self.port.next.remote()
            except Exception:  # the port is fate-shared with this replica; this is only a hiccup
                log.exception("reading the KV port failed")
                await asyncio.sleep(0.1)
                continue
            if isinstance(message, Release):
                await self._release(message.request_id)
                await self.port.reply.remote(key, None)
            else:
                queue = self.peers.get(message.decode_replica)
                if queue is None:
                    queue = self.peers[message.decode_replica] = asyncio.Queue()
                    self._tasks.append(asyncio.create_task(self._serve_peer(queue)))
                queue.put_nowait((key, message))

    async def _serve_peer(self, queue: asyncio.Queue) -> None:
        """One decode peer's fetches, strictly in order: its recvs are in the same order."""
        while True:
            key, fetch = await queue.get()
            try:
                await self._fetch(key, fetch)
            except Exception:
                log.exception("KV fetch %s failed", fetch.request_id)
                self.pairs.pop(fetch.group_name, None)  # decode moves to a new group after a failure
                await self._release(fetch.request_id)

    async def _fetch(self, key: str, fetch: Fetch) -> None:
        expiry = self.leases.pop(fetch.request_id, None)
        if expiry is None or expiry <= time.monotonic():
            await self._release(fetch.request_id)
            await self.port.reply.remote(key, FetchReply(False, "lease expired or unknown"))
            return
        start = time.perf_counter()
        if self.args.fault_delay_kv_send_s:
            await asyncio.sleep(self.args.fault_delay_kv_send_s)
        kv = await self.engine.call(lambda e: e.export_kv(fetch.request_id))
        kv_bytes = kv.numel() * kv.element_size()
        transport = self.args.transport
        if transport == "object_store":
            ref = ray.put(kv_as_bytes(kv))
            await self._release(fetch.request_id)
            await self.port.reply.remote(key, FetchReply(True, kv_bytes=kv_bytes, kv_ref=[ref]))
        else:
            await self.port.reply.remote(key, FetchReply(True, kv_bytes=kv_bytes))
            pair = self.pairs.get(fetch.group_name)
            timeout = self.args.transfer_timeout_s
            if pair is None:
                pair = await asyncio.to_thread(open_pair, transport, fetch.group_name, 0, timeout)
                self.pairs[fetch.group_name] = pair
            await asyncio.wait_for(asyncio.to_thread(pair.send, kv), timeout)
            await self._release(fetch.request_id)  # the matching recv is decode's acknowledgement
        seconds = time.perf_counter() - start
        event = KvSent(fetch.request_id, transport, kv_bytes, seconds, self.name, fetch.decode_replica)
        self.ledger.record.remote([event], self.name)

    async def _release(self, request_id: str) -> None:
        self.leases.pop(request_id, None)
        await self.engine.call(lambda e: e.release(request_id))

    async def _expire_leases(self) -> None:
        while True:
            now = time.monotonic()
            for request_id in [r for r, expiry in self.leases.items() if expiry <= now]:
                log.warning("KV lease of %s expired; decode will recompute", request_id)
                await self._release(request_id)
            await asyncio.sleep(LEASE_CHECK_PERIOD_S)

    def __del__(self) -> None:
        self.engine.shutdown()

