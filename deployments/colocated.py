"""One engine that prefills and decodes (mode: colocated): the baseline P/D is measured against."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray import serve

from deployments.common import build_engine, ledger_actor, replica_name, report_stats_forever
from deployments.metrics import EngineMetrics
from deployments.config import AppArgs
from pegaserve.engine.async_engine import in_chunks
from pegaserve.engine.engine import Role
from pegaserve.engine.request import EngineRequest, StepOutput


@serve.deployment(name="Colocated")
class ColocatedServer:
    async def __init__(self, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.engine = build_engine(self.args, Role.BOTH)
        self.name = replica_name()
        self.ledger = ledger_actor(self.args)
        metrics = EngineMetrics(self.args.model, "Colocated", self.name)
        self._stats_task = asyncio.create_task(report_stats_forever(self.engine, self.ledger, metrics, self.name, "both"))

    async def generate(self, spec: EngineRequest) -> AsyncIterator[StepOutput]:
        async for output in in_chunks(self.engine.generate(spec), self.args.stream_interval):
            yield output

    def __del__(self) -> None:
        self.engine.shutdown()
