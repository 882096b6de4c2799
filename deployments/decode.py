"""The decode deployment: claim the prompt's KV from the prefill replica that holds it (only the
blocks this replica's prefix cache lacks), continue after the first tokens (never re-sampling
them), and stream every step's tokens to the ingress."""

from __future__ import annotations

from ray import serve

from deployments.channel import Address
from deployments.engine_server import EngineServer
from deployments.handoff.protocol import Lease
from deployments.handoff.receiver import KvReceiver
from deployments.metrics import TransferMetrics
from pegaserve.engine.config import Role
from pegaserve.engine.request import EngineRequest, Handoff, SampledToken
from pegaserve.ledger import Fallback, KvReceived


@serve.deployment(name="Decode")
class Decode(EngineServer):
    def __init__(self, args: dict) -> None:
        super().__init__(args, Role.DECODE, "Decode")
        self.receiver = KvReceiver(self.engine, self.name, self.args.transport, self.args.transfer_timeout_s)
        used = {"shm": ("shm", "gloo")}.get(self.args.transport, (self.args.transport,))  # shm: gloo across nodes
        self.transfers = TransferMetrics(self.args.served_name, "Decode", used)

    async def generate(self, request: EngineRequest, choices: tuple[tuple[int, tuple[SampledToken, ...]], ...],
                       lease: Lease | None, reply_to: Address, tag: int) -> None:
        """Continue `choices` of `request` (each with its tokens so far) and stream their tokens to
        `reply_to`; with no lease (a resume), the prompt and those tokens are recomputed here."""
        if lease is None:
            return await self._resume(request, choices, reply_to, tag)
        handoff = Handoff(request, choices)
        await self._serve(request, handoff.choice_ids, reply_to, tag, self._receive(handoff, lease))

    async def _receive(self, handoff: Handoff, lease: Lease) -> None:
        request_id = handoff.request.request_id
        target = await self.engine.receive(handoff)
        if target is None:
            return self._fell_back(handoff, self.receiver.transport_for(lease), "no free blocks to import")
        transfer = await self.receiver.fetch(lease, target, tuple(handoff.choice_ids))
        await self.engine.received(request_id, transfer.ok)
        if not transfer.ok:
            return self._fell_back(handoff, transfer.transport, transfer.reason)
        cached_bytes = target.first_block * lease.block_bytes  # already in this replica's prefix cache
        self.transfers.transferred(transfer.transport, transfer.kv_bytes, transfer.seconds, cached_bytes)
        self.ledger.record([KvReceived(c, transfer.transport, transfer.kv_bytes, transfer.seconds, self.name,
                                       cached_bytes) for c in handoff.choice_ids])

    def _fell_back(self, handoff: Handoff, transport: str, reason: str) -> None:
        self.transfers.fallback(transport)
        self.ledger.record([Fallback(c, reason, self.name) for c in handoff.choice_ids])
