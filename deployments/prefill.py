"""The prefill deployment: prompt forward, first tokens sampled and classified, the KV kept under
a lease and sent to whichever decode replica claims it (docs/contract.md rules 21-22)."""

from __future__ import annotations

import asyncio

from ray import serve

from pegaserve.config import Role
from pegaserve.deployments.calls import PrefillResult, pack, unpack
from pegaserve.deployments.config import AppArgs
from pegaserve.deployments.ledger import stats_board
from pegaserve.deployments.metrics import EngineMetrics
from pegaserve.deployments.node import this_node
from pegaserve.deployments.replica import (
    QUIET,
    check_engine,
    ledger_buffer,
    post_stats_forever,
    replica_name,
    start_engine,
)
from pegaserve.heap import freeze_startup_heap
from pegaserve.messages import EngineRequest
from pegaserve.pd.sender import KvSender
from pegaserve.testing.hook import active_doubles


@serve.deployment(name="Prefill", logging_config=QUIET)
class Prefill:
    async def __init__(self, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.name = replica_name()
        self.engine = start_engine(self.args, Role.PREFILL)
        self.ledger = ledger_buffer(self.args, self.name)
        doubles = active_doubles()
        self.sender = KvSender(self.engine, self.name, self.args.transport, self.args.transfer_timeout_s, self.ledger,
                               doubles.delay_kv_send_s if doubles else 0.0, push=self.args.push_kv, node=this_node())
        await self.sender.start()
        metrics = EngineMetrics(self.args.served_name, "Prefill", self.name)
        stats_board().announce.remote(self.name, self.sender.address)  # where ingresses send releases
        self._stats = asyncio.ensure_future(post_stats_forever(self.engine, metrics, self.name, "prefill"))
        freeze_startup_heap()

    async def prefill(self, packed_request: bytes) -> bytes:
        """The packed `PrefillResult` of a packed `EngineRequest` (deployments/calls.py)."""
        request = unpack(packed_request, EngineRequest)
        outputs = await self.engine.prefill(request)  # the ingress records them in the ledger
        lease = None
        if any(o.finish is None for o in outputs):
            lease = await self.sender.lease(request, outputs)
        return pack(PrefillResult(outputs, self.name, lease))

    async def check_health(self) -> None:
        check_engine(self.engine)
        if not self.sender.serving:
            raise RuntimeError("the KV server stopped")

    def __del__(self) -> None:
        self.engine.shutdown()
