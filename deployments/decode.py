"""The decode deployment: claim the prompt's KV from the prefill replica that holds it (only the
blocks this replica's prefix cache lacks), continue after the first tokens (never re-sampling
them), and stream every step's tokens to the ingress."""

from __future__ import annotations

from ray import serve

from pegaserve.config import Role
from pegaserve.deployments.calls import DecodeCall, unpack
from pegaserve.deployments.engine_server import EngineServer
from pegaserve.deployments.metrics import TransferMetrics
from pegaserve.deployments.node import this_node
from pegaserve.deployments.replica import QUIET
from pegaserve.engine import commands
from pegaserve.ledger import Fallback, KvReceived
from pegaserve.messages import Handoff
from pegaserve.pd.protocol import Lease
from pegaserve.pd.receiver import KvReceiver


@serve.deployment(name="Decode", logging_config=QUIET)
class Decode(EngineServer):
    role, deployment = Role.DECODE, "Decode"

    def __init__(self, args: dict) -> None:
        super().__init__(args)
        self.receiver = KvReceiver(self.engine, self.name, self.args.transport, self.args.transfer_timeout_s,
                                   node=this_node())
        self.transfers = TransferMetrics(self.args.served_name, "Decode", self.receiver.transport.names)

    async def generate(self, packed_call: bytes) -> None:
        """Run a packed `DecodeCall` (deployments/calls.py): continue its choices (each with its
        tokens so far), streaming their tokens to the ingress, after the KV handoff or, with no
        lease (a resume), recomputing the prompt and those tokens here."""
        call = unpack(packed_call, DecodeCall)
        if call.lease is None:
            return await self._resume(call.request, call.choices, call.reply_to, call.tag)
        handoff = Handoff(call.request, call.choices)
        await self._serve(call.request, handoff.choice_ids, call.reply_to, call.tag, self._receive(handoff, call.lease))

    async def _receive(self, handoff: Handoff, lease: Lease) -> None:
        if self.receiver.copies_in_engine(lease):
            return await self._receive_in_engine(handoff, lease)
        request_id = handoff.request.request_id
        target = await self.engine.receive(handoff)
        if target is None:
            self.receiver.release(lease)
            return self._fell_back(handoff, self.receiver.transport_for(lease), "no free blocks to import")
        transfer = await self.receiver.fetch(lease, target, tuple(handoff.choice_ids))
        await self.engine.received(request_id, transfer.ok)
        if not transfer.ok:
            return self._fell_back(handoff, transfer.transport, transfer.reason)
        self._received(handoff, lease, transfer.transport, transfer.kv_bytes, transfer.seconds, target.first_block,
                       transfer.pushed)

    async def _receive_in_engine(self, handoff: Handoff, lease: Lease) -> None:
        """On one node: the engine copies the blocks out of the prefill engine's cache as it
        admits the request, so the request runs in the next step."""
        choice_ids = tuple(handoff.choice_ids)
        transport = self.receiver.transport_for(lease)
        source = commands.SharedKv(lease.shared.path, lease.shared.shape, lease.parked)
        receipt = await self.engine.call(commands.AddSharedHandoff(handoff, source))
        if receipt is None:
            self.receiver.release(lease)
            return self._fell_back(handoff, transport, "no free blocks to import")
        kv_bytes = receipt.num_blocks * lease.block_bytes
        await self.receiver.copied(lease, choice_ids, kv_bytes, receipt.seconds, receipt.held)  # prefill frees
        if not receipt.held:
            return self._fell_back(handoff, transport, "lease expired or unknown")
        first_block = len(lease.parked.block_ids) - receipt.num_blocks
        self._received(handoff, lease, transport, kv_bytes, receipt.seconds, first_block)

    def _received(self, handoff: Handoff, lease: Lease, transport: str, kv_bytes: int, seconds: float,
                  first_block: int, pushed: bool = False) -> None:
        cached_bytes = first_block * lease.block_bytes  # already in this replica's prefix cache
        self.transfers.transferred(transport, kv_bytes, seconds, cached_bytes)
        self.ledger.record([KvReceived(c, transport, kv_bytes, seconds, self.name, cached_bytes, pushed)
                            for c in handoff.choice_ids])

    def _fell_back(self, handoff: Handoff, transport: str, reason: str) -> None:
        self.transfers.fallback(transport)
        self.ledger.record([Fallback(c, reason, self.name) for c in handoff.choice_ids])
