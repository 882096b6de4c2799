"""What Decode and Colocated replicas share: a request's tokens go to the ingress that asked, in
per-step batches (`TokenRouter`), while the Serve call that started it stays open until it is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from pegaserve.deployments.calls import Choices
from pegaserve.deployments.replica import EngineReplica, replica_name
from pegaserve.engine import commands
from pegaserve.heap import freeze_startup_heap
from pegaserve.messages import EngineRequest, Handoff
from pegaserve.net.channel import Address
from pegaserve.net.tokens import TokenRouter


class EngineServer(EngineReplica):
    def __init__(self, args: dict) -> None:
        self.router = TokenRouter(replica_name(), on_abort=self._abort)
        super().__init__(args, on_step=self.router.on_step)
        self.engine.on_dead = self.router.fail
        freeze_startup_heap()

    def _abort(self, choice_id: str) -> None:
        self.engine.abort(choice_id)

    async def _serve(self, request: EngineRequest, choice_ids: list[str], reply_to: Address, tag: int,
                     admit: Awaitable) -> None:
        """Route the choices' outputs to `reply_to`, admit the request, return once every choice has
        finished. Cancelled (the ingress gave up): the request is aborted; its admission still runs
        to its end (a KV transfer is never cut in the middle)."""
        done = self.router.route(choice_ids, reply_to, tag)
        admitted = asyncio.ensure_future(admit)
        try:
            await asyncio.shield(admitted)
            await asyncio.shield(done)  # (cancelling a bare future would cancel `done` itself)
        finally:
            if not done.done():
                self.router.unroute(choice_ids)
                self.engine.abort(request.request_id)

    async def _resume(self, request: EngineRequest, choices: Choices, reply_to: Address, tag: int) -> None:
        """Continue choices that already have tokens (their replica died): recomputed here."""
        handoff = Handoff(request, choices)
        await self._serve(request, handoff.choice_ids, reply_to, tag, self.engine.call(commands.AddHandoff(handoff)))
