"""One engine that prefills and decodes (mode: colocated): the baseline P/D is measured against."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray import serve

from deployments.common import build_engine, ledger_actor, replica_name
from deployments.config import AppArgs
from pegaserve.engine.engine import Role
from pegaserve.engine.request import EngineRequest, StepOutput

STATS_PERIOD_S = 1.0


@serve.deployment(name="Colocated")
class ColocatedServer:
    async def __init__(self, args: dict) -> None:
        self.args = AppArgs.model_validate(args)
        self.engine = build_engine(self.args, Role.BOTH)
        self.name = replica_name()
        self.ledger = ledger_actor(self.args.ledger_max_records)
        self._stats_task = asyncio.create_task(self._report_stats())

    async def generate(self, spec: EngineRequest) -> AsyncIterator[StepOutput]:
        async for output in self.engine.generate(spec):
            yield output

    async def _report_stats(self) -> None:
        while True:
            stats = await self.engine.call(lambda e: e.stats())
            self.ledger.report_stats.remote(self.name, {**stats.__dict__, "role": "both"})
            await asyncio.sleep(STATS_PERIOD_S)

    def __del__(self) -> None:
        self.engine.shutdown()
