"""The KV transport seam (pegaserve/pd/transports/): a transport of this test's own, registered here
— no product file names it — moves real prompts' KV from a prefill engine to a decode engine in
this process, through the same KvSender and KvReceiver as the built-in transports, and decode
gives the same tokens as over the built-in gloo pair. No Ray."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pegaserve.config import EngineConfig, Role
from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.engine.build import load_engine
from pegaserve.messages import Handoff, ParkedKv, ReceiveTarget, StepOutput
from pegaserve.pd.protocol import Lease
from pegaserve.pd.receiver import KvReceiver
from pegaserve.pd.sender import KvSender
from pegaserve.pd.transports.base import KvTransport, LeaseKv, Receiving, to_the_end
from pegaserve.pd.transports.registry import register_transport, transport_names, unregister_transport
from pegaserve.runner.model_runner import pack_blocks, unpack_blocks
from tests.helpers import PROMPTS, greedy_request
from tests.pd.test_handoff_fetch import NODE, TIMEOUT_S, Ledger, pairs_closed

NEW_TOKENS = 12
NUM_BLOCKS = 128
PARCELS: dict[str, torch.Tensor] = {}  # the test transport's wire: request id -> the prompt's packed KV


class ParcelTransport(KvTransport):
    """Prefill packs a prompt's blocks into a parcel as it leases them (freeing them at once, as the
    lease's KV has left); decode unpacks the parcel into the blocks its engine reserved."""

    name = "test-parcel"
    frees_at_lease = True

    async def lease_kv(self, engine: AsyncEngine, request_id: str, parked: ParkedKv) -> LeaseKv:
        packed = await asyncio.to_thread(pack_blocks, engine.kv_cache, parked.block_ids)
        if parked.intact(parked.block_ids, engine.kv_generations, time.monotonic()):
            PARCELS[request_id] = packed
        engine.release(request_id)
        return LeaseKv()

    async def receive(self, receiver: Receiving, lease: Lease, target: ReceiveTarget,
                      choice_ids: tuple[str, ...]) -> int | None:
        parcel = PARCELS.pop(lease.request_id, None)
        if parcel is None:
            return None
        packed = parcel[:, :, target.first_block :]
        await to_the_end(asyncio.to_thread(unpack_blocks, receiver.kv_cache, target.block_ids, packed))
        return packed.numel() * packed.element_size()


@pytest.fixture
def parcel():
    register_transport(ParcelTransport)
    yield ParcelTransport.name
    unregister_transport(ParcelTransport.name)
    PARCELS.clear()


def engine(model_dir: str, role: Role, on_step=None) -> AsyncEngine:
    core = load_engine(model_dir, EngineConfig(role=role, num_blocks=NUM_BLOCKS), attention_backend="sdpa")
    return AsyncEngine.in_thread(core, on_step)


def disaggregated(model_dir: str, transport: str, prompts: list[list[int]]) -> tuple[dict[str, list[int]], list]:
    """Each prompt prefilled, its KV handed over by `transport`, decoded to the end: the tokens (the
    first, prefill's, then decode's) by request id, and the transfers."""

    async def main():
        outputs: dict[str, list[StepOutput]] = {}
        finished = asyncio.Event()

        def on_step(step: list[StepOutput]) -> None:
            for output in step:
                outputs[output.request_id].append(output)
            if len(outputs) == len(prompts) and all(o[-1].finish is not None for o in outputs.values()):
                finished.set()

        prefill, decode = engine(model_dir, Role.PREFILL), engine(model_dir, Role.DECODE, on_step)
        sender = KvSender(prefill, "prefill", transport, TIMEOUT_S, Ledger(), node=NODE)
        await sender.start()
        receiver = KvReceiver(decode, "decode", transport, TIMEOUT_S, node=NODE)
        transfers = []
        try:
            for i, prompt in enumerate(prompts):
                request = greedy_request(f"r{i}", prompt, NEW_TOKENS)
                (first,) = await prefill.prefill(request)
                assert first.finish is None
                outputs[request.request_id] = [first]
                lease = await sender.lease(request, [first])
                handoff = Handoff.single(request, first.tokens[0])
                target = await decode.receive(handoff)
                transfer = await receiver.fetch(lease, target, tuple(handoff.choice_ids))
                await decode.received(request.request_id, transfer.ok)
                transfers.append(transfer)
            await asyncio.wait_for(finished.wait(), TIMEOUT_S)
            stats = await prefill.stats()
            assert stats.num_parked == 0 and stats.num_free_blocks == NUM_BLOCKS  # every lease freed
        finally:
            receiver.close()
            await pairs_closed()
            sender.close()
            prefill.shutdown()
            decode.shutdown()
        return {rid: [t.token_id for o in outs for t in o.tokens] for rid, outs in outputs.items()}, transfers

    return asyncio.run(main())


def test_a_transport_registered_from_outside_moves_the_kv_and_gives_the_built_in_paths_tokens(tiny_model_dir, parcel):
    assert parcel in transport_names()
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[7]]
    tokens, transfers = disaggregated(tiny_model_dir, parcel, prompts)
    assert all(t.ok and t.transport == parcel and t.kv_bytes > 0 for t in transfers)
    assert not PARCELS  # every parcel was taken
    built_in, gloo_transfers = disaggregated(tiny_model_dir, "gloo", prompts)
    assert all(t.ok and t.transport == "gloo" for t in gloo_transfers)
    assert tokens == built_in
    assert all(len(t) == NEW_TOKENS for t in tokens.values())
