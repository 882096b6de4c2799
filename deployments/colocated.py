"""One engine that prefills and decodes (mode: colocated): the baseline P/D is measured against."""

from __future__ import annotations

from ray import serve

from pegaserve.config import Role
from pegaserve.deployments.calls import ColocatedCall, unpack
from pegaserve.deployments.engine_server import EngineServer
from pegaserve.deployments.replica import QUIET
from pegaserve.engine import commands


@serve.deployment(name="Colocated", logging_config=QUIET)
class Colocated(EngineServer):
    role, deployment = Role.BOTH, "Colocated"

    async def generate(self, packed_call: bytes) -> None:
        """Run a packed `ColocatedCall` (deployments/calls.py): its request, or the resume of some
        of its choices, streaming their tokens to the ingress."""
        call = unpack(packed_call, ColocatedCall)
        if call.choices is not None:
            return await self._resume(call.request, call.choices, call.reply_to, call.tag)
        request = call.request
        choice_ids = [request.choice_id(i) for i in range(request.n)]
        await self._serve(request, choice_ids, call.reply_to, call.tag, self.engine.call(commands.AddRequest(request)))
