"""The prefill deployment: prompt forward, first tokens sampled and classified, the KV kept under
a lease and sent to whichever decode replica claims it (docs/contract.md rules 21-22)."""

from __future__ import annotations

import asyncio

from ray import serve

from pegaserve.config import Role
from pegaserve.deployments.calls import PrefillResult, pack, unpack
from pegaserve.deployments.node import this_node
from pegaserve.deployments.registry import kv_servers
from pegaserve.deployments.replica import QUIET, EngineReplica
from pegaserve.heap import freeze_startup_heap
from pegaserve.messages import EngineRequest
from pegaserve.pd.sender import KvSender
from pegaserve.testing.hook import active_doubles

ANNOUNCE_PERIOD_S = 1.0


@serve.deployment(name="Prefill", logging_config=QUIET)
class Prefill(EngineReplica):
    role, deployment = Role.PREFILL, "Prefill"

    async def __init__(self, args: dict) -> None:
        super().__init__(args)
        doubles = active_doubles()
        self.sender = KvSender(self.engine, self.name, self.args.transport, self.args.transfer_timeout_s, self.ledger,
                               doubles.delay_kv_send_s if doubles else 0.0, push=self.args.push_kv, node=this_node())
        await self.sender.start()
        self._announcing = asyncio.ensure_future(self._announce_forever())
        freeze_startup_heap()

    async def _announce_forever(self) -> None:
        """Tell the directory where this replica's KV server listens (where ingresses send the
        releases of leases they will not use), again and again: silence means gone."""
        directory = kv_servers()
        while True:
            directory.announce.remote(self.name, self.sender.address)
            await asyncio.sleep(ANNOUNCE_PERIOD_S)

    async def prefill(self, packed_request: bytes) -> bytes:
        """The packed `PrefillResult` of a packed `EngineRequest` (deployments/calls.py)."""
        request = unpack(packed_request, EngineRequest)
        outputs = await self.engine.prefill(request)  # the ingress records them in the ledger
        lease = None
        if any(o.finish is None for o in outputs):
            lease = await self.sender.lease(request, outputs)
        return pack(PrefillResult(outputs, self.name, lease))

    async def check_health(self) -> None:
        await super().check_health()
        if not self.sender.serving:
            raise RuntimeError("the KV server stopped")
