"""One engine that prefills and decodes (mode: colocated): the baseline P/D is measured against."""

from __future__ import annotations

from ray import serve

from deployments.channel import Address
from deployments.engine_server import EngineServer
from pegaserve.engine import core
from pegaserve.engine.config import Role
from pegaserve.engine.request import EngineRequest, SampledToken


@serve.deployment(name="Colocated")
class Colocated(EngineServer):
    def __init__(self, args: dict) -> None:
        super().__init__(args, Role.BOTH, "Colocated")

    async def generate(self, request: EngineRequest, reply_to: Address, tag: int,
                       choices: tuple[tuple[int, tuple[SampledToken, ...]], ...] | None = None) -> None:
        """Run `request` (or resume `choices` of it) and stream its tokens to `reply_to`."""
        if choices is not None:
            return await self._resume(request, choices, reply_to, tag)
        choice_ids = [request.choice_id(i) for i in range(request.n)]
        await self._serve(request, choice_ids, reply_to, tag, self.engine.call(core.AddRequest(request)))
