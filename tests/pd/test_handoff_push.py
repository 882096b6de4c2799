"""KV pushed before decode asks (pegaserve/pd/push.py), between a KvSender and a KvReceiver
on 127.0.0.1 over a real gloo pair: once a pair is open, a lease's blocks travel as it is made,
decode's fetch copies them out of what landed, and only what decode needs (after its cached
prefix). A read that did not hold is turned away; a lease pushed on another pair, or with two
decode replicas paired, is fetched as before; a push and a fetch may be under way on one pair."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import torch

from pegaserve.messages import ParkedKv, StepOutput
from pegaserve.pd.receiver import KvReceiver
from pegaserve.pd.sender import KvSender
from tests.pd.test_handoff_fetch import (
    NODE,
    PROMPT_BLOCKS,
    SHAPE,
    TARGET,
    TIMEOUT_S,
    DecodeEngine,
    expected_target,
    lease_of,
    random_cache,
    released,
    run,
)


async def lease(sender: KvSender, request_id: str, held_for_s: float = 60.0):
    """The lease `sender` makes of a request parked on PROMPT_BLOCKS (pushed where it can be)."""
    generations = sender.engine.kv_generations
    parked = ParkedKv(PROMPT_BLOCKS, tuple(generations[b] for b in PROMPT_BLOCKS), time.monotonic() + held_for_s)
    return await sender.lease(SimpleNamespace(request_id=request_id), [StepOutput(request_id, (), parked=parked)])


async def landed(receiver: KvReceiver, request_id: str) -> None:
    inbox = next(iter(receiver._peers.values())).inbox
    for _ in range(500):
        if request_id in inbox._landed:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"the push of {request_id} never landed")


def test_a_lease_is_pushed_once_a_pair_is_open_and_decode_copies_what_it_needs():
    async def scenario(prefill, sender, receiver):
        first = await lease(sender, "r1")
        assert first.pushed_to is None  # no pair yet: fetched
        assert (await receiver.fetch(first, TARGET, ("r1",))).ok and await released(prefill, "r1")
        decode_cache = receiver.engine.kv_cache
        decode_cache.zero_()
        pushed = await lease(sender, "r2")
        assert pushed.pushed_to == next(iter(receiver._peers.values())).group_name
        await landed(receiver, "r2")
        pushed_kv = prefill.kv_cache.clone()
        prefill.kv_cache.add_(1)  # after the push: what decode copies is what was pushed
        transfer = await receiver.fetch(pushed, TARGET, ("r2",))
        assert transfer.ok and transfer.pushed and transfer.transport == "gloo"
        assert transfer.kv_bytes == len(TARGET.block_ids) * pushed.block_bytes
        assert torch.equal(decode_cache, expected_target(pushed_kv, torch.zeros(SHAPE)))
        assert await released(prefill, "r2")
        assert [(r.request_id, r.transport) for r in sender.ledger.records] == [("r1", "gloo"), ("r2", "gloo")]
        assert sender.num_pairs == 1

    run("gloo", scenario)


def test_a_push_whose_read_did_not_hold_is_recomputed_and_the_pair_stays_in_step():
    async def scenario(prefill, sender, receiver):
        assert (await receiver.fetch(await lease(sender, "r1"), TARGET, ("r1",))).ok  # the pair opens
        expired = await lease(sender, "expired", held_for_s=-1.0)  # over before the push read it
        assert expired.pushed_to is not None
        transfer = await receiver.fetch(expired, TARGET, ("expired",))
        assert not transfer.ok and transfer.reason == "lease expired or unknown"
        assert await released(prefill, "expired")
        decode_cache = receiver.engine.kv_cache
        decode_cache.zero_()
        fresh = await lease(sender, "r2")
        assert fresh.pushed_to is not None and (await receiver.fetch(fresh, TARGET, ("r2",))).pushed
        assert torch.equal(decode_cache, expected_target(prefill.kv_cache, torch.zeros(SHAPE)))
        assert await released(prefill, "r2")
        assert [r.request_id for r in sender.ledger.records] == ["r1", "r2"] and sender.num_pairs == 1

    run("gloo", scenario)


def test_a_fetch_and_a_push_share_a_pair_and_leases_pushed_elsewhere_are_fetched():
    async def scenario(prefill, sender, receiver):
        sender.delay_send_s = 0.5  # the pair's fetches are held back at prefill (its thread reads it per fetch)
        assert (await receiver.fetch(await lease(sender, "r1"), TARGET, ("r1",))).ok
        assert await released(prefill, "r1")  # its thread is waiting for the next fetch: held back too
        sender.delay_send_s = 0.0  # pushes are not
        decode_cache = receiver.engine.kv_cache
        decode_cache.zero_()
        elsewhere = lease_of(sender, "elsewhere")  # as if pushed on another decode replica's pair
        elsewhere = type(elsewhere)(**{**elsewhere.__dict__, "pushed_to": "pegaserve-kv-prefill-other-1"})
        other_target = type(TARGET)((20, 21, 22, 23, 24, 25, 26, 27), 1)
        fetching = asyncio.ensure_future(receiver.fetch(elsewhere, other_target, ("elsewhere",)))
        await asyncio.sleep(0.2)
        claimed = await receiver.fetch(await lease(sender, "pushed"), TARGET, ("pushed",))
        assert claimed.ok and claimed.pushed and not fetching.done()
        fetched = await fetching
        assert fetched.ok and not fetched.pushed
        expected = expected_target(prefill.kv_cache, torch.zeros(SHAPE))
        expected[:, :, list(other_target.block_ids)] = prefill.kv_cache[:, :, list(PROMPT_BLOCKS[1:])]
        assert torch.equal(decode_cache, expected)

    run("gloo", scenario)


def test_with_two_decode_replicas_paired_nothing_is_pushed():
    async def scenario(prefill, sender, receiver):
        other = KvReceiver(DecodeEngine(random_cache(5)), "decode-2", "gloo", TIMEOUT_S, node=NODE)
        try:
            for decode, name in ((receiver, "r1"), (other, "r2")):
                assert (await decode.fetch(await lease(sender, name), TARGET, (name,))).ok
            assert sender.num_pairs == 2
            both = await lease(sender, "r3")
            assert both.pushed_to is None and (await other.fetch(both, TARGET, ("r3",))).ok
        finally:
            other.close()

    run("gloo", scenario)


def test_push_kv_off_fetches_every_lease():
    async def scenario(prefill, sender, receiver):
        sender.push = False
        for name in ("r1", "r2"):
            lent = await lease(sender, name)
            assert lent.pushed_to is None and (await receiver.fetch(lent, TARGET, (name,))).ok

    run("gloo", scenario)
