"""The handoff's fetch between a KvSender and a KvReceiver (pegaserve/pd/) on 127.0.0.1,
with stand-in engines whose loops must never be asked anything: the bytes are read straight from
the prefill engine's cache and checked against the lease (`ParkedKv`) once read. A lease that
expired, or a block handed out anew, turns the bytes away — the pair stays in step for the next
fetch and decode recomputes. Over a real gloo pair, and over shared memory (decode copying out
of the prefill engine's cache file)."""

import asyncio
import dataclasses
import os
import threading
import time
import uuid
from array import array

import pytest
import torch

from pegaserve.engine.process import SHM_DIR, map_kv_file
from pegaserve.messages import ParkedKv, ReceiveTarget
from pegaserve.net.node import NodeInfo
from pegaserve.pd.pair_channel import block_bytes, packed_shape
from pegaserve.pd.protocol import Lease, SharedCache
from pegaserve.pd.receiver import KvReceiver
from pegaserve.pd.sender import KvSender

TIMEOUT_S = 30.0
SHAPE = (3, 2, 40, 4, 2, 8)  # [layers, 2, blocks, block_size, kv_heads, head_dim]
PROMPT_BLOCKS = (3, 4, 5, 6, 7, 8, 9, 10, 2)  # where the prompt lies in prefill's cache
TARGET = ReceiveTarget((30, 31, 32, 33, 34, 35, 36, 37), 1)  # decode has the first block cached
NODE = NodeInfo("node", "127.0.0.1")  # both sides: one node, on loopback


class PrefillEngine:
    """The prefill engine as the sender sees it: its cache, its blocks' generations, releases."""

    def __init__(self, cache: torch.Tensor, generations, kv_path: str | None = None) -> None:
        self.kv_cache = cache
        self.kv_generations = generations
        self.kv_path = kv_path
        self.released: list[str] = []

    async def call(self, command):
        raise AssertionError(f"a handoff asked the engine loop {command!r}")

    def release(self, request_id: str) -> None:
        self.released.append(request_id)


class DecodeEngine:
    def __init__(self, cache: torch.Tensor) -> None:
        self.kv_cache = cache


class Ledger:
    def __init__(self) -> None:
        self.records: list = []

    def record(self, records: list) -> None:
        self.records += records


def random_cache(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def lease_of(sender: KvSender, request_id: str, held_for_s: float = 60.0) -> Lease:
    cache, generations = sender.engine.kv_cache, sender.engine.kv_generations
    parked = ParkedKv(PROMPT_BLOCKS, tuple(generations[b] for b in PROMPT_BLOCKS), time.monotonic() + held_for_s)
    shared = None if sender.engine.kv_path is None else SharedCache(NODE.node_id, sender.engine.kv_path, SHAPE)
    return Lease(request_id, "prefill", sender.address, packed_shape(cache, len(PROMPT_BLOCKS)), "float32",
                 block_bytes(cache), parked, shared=shared)


def expected_target(prefill: torch.Tensor, decode: torch.Tensor) -> torch.Tensor:
    expected = decode.clone()
    expected[:, :, list(TARGET.block_ids)] = prefill[:, :, list(PROMPT_BLOCKS[1:])]
    return expected


async def released(prefill: PrefillEngine, request_id: str) -> bool:
    """Prefill frees the blocks after decode is done with them (its send over, or `Copied` read)."""
    for _ in range(200):
        if request_id in prefill.released:
            return True
        await asyncio.sleep(0.01)
    return False


def run(transport: str, scenario, kv_path: str | None = None) -> None:
    async def main():
        if kv_path is None:
            prefill = PrefillEngine(random_cache(1), array("q", bytes(8 * SHAPE[2])))
        else:
            prefill = PrefillEngine(*map_kv_file(kv_path, SHAPE, torch.float32), kv_path)
        sender = KvSender(prefill, "prefill", transport, TIMEOUT_S, Ledger(), node=NODE)
        await sender.start()
        receiver = KvReceiver(DecodeEngine(random_cache(2)), "decode", transport, TIMEOUT_S, node=NODE)
        try:
            await asyncio.wait_for(scenario(prefill, sender, receiver), TIMEOUT_S)
        finally:
            receiver.close()
            await pairs_closed()
            sender.close()

    asyncio.run(main())


def test_gloo_blocks_land_where_decode_asked_without_the_engine_loop():
    async def scenario(prefill, sender, receiver):
        decode_cache = receiver.engine.kv_cache
        expected = expected_target(prefill.kv_cache, decode_cache)
        transfer = await receiver.fetch(lease_of(sender, "r1"), TARGET, ("r1",))
        assert transfer.ok and transfer.transport == "gloo" and transfer.kv_bytes == 8 * block_bytes(decode_cache)
        assert torch.equal(decode_cache, expected)
        assert await released(prefill, "r1") and [r.request_id for r in sender.ledger.records] == ["r1"]

    run("gloo", scenario)


def test_gloo_a_lease_not_held_turns_the_bytes_away_and_the_pair_stays_in_step():
    async def scenario(prefill, sender, receiver):
        expired = await receiver.fetch(lease_of(sender, "gone", held_for_s=-1.0), TARGET, ("gone",))
        assert not expired.ok and expired.reason == "lease expired or unknown"
        reused = lease_of(sender, "reused")
        prefill.kv_generations[PROMPT_BLOCKS[-1]] += 1  # its last block was handed out anew
        assert not (await receiver.fetch(reused, TARGET, ("reused",))).ok
        assert sender.ledger.records == []
        decode_cache = receiver.engine.kv_cache
        decode_cache.zero_()
        assert (await receiver.fetch(lease_of(sender, "r2"), TARGET, ("r2",))).ok
        assert torch.equal(decode_cache, expected_target(prefill.kv_cache, torch.zeros(SHAPE)))
        assert sender.num_pairs == 1  # the same pair carried all three
        assert await released(prefill, "r2") and prefill.released == ["gone", "reused", "r2"]

    run("gloo", scenario)


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_a_lease_decode_will_not_read_is_freed_at_once_without_a_send(transport, request):
    """Every block already cached on decode, or decode recomputing (no room, a fetch that failed):
    decode tells prefill, which frees the blocks now rather than at the lease's expiry. The ingress
    counts on it: it leaves the lease to the decode call that carried it (deployments/orchestration.py)."""

    async def scenario(prefill, sender, receiver):
        cached = await receiver.fetch(lease_of(sender, "cached"), ReceiveTarget((), len(PROMPT_BLOCKS)), ("cached",))
        assert cached.ok and cached.kv_bytes == 0
        assert await released(prefill, "cached")
        receiver.release(lease_of(sender, "no-room"))
        assert await released(prefill, "no-room")
        assert receiver.transport_for(lease_of(sender, "any")) == transport
        assert sender.ledger.records == [] and sender.num_pairs == 0  # nothing was sent

    run(transport, scenario, request.getfixturevalue("kv_file") if transport == "shm" else None)


def pair_threads() -> int:
    return sum(t.name.startswith(("pegaserve-kv-pair", "pegaserve-kv-inbox")) for t in threading.enumerate())


async def pairs_closed() -> None:
    """Both sides' threads of every pair ended (prefill's closes an inbox's, then its own ends)."""
    for _ in range(500):
        if pair_threads() == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{pair_threads()} pair threads left")


def test_gloo_a_fetch_never_waits_for_the_senders_event_loop():
    """On gloo the fetch travels on the pair itself, to the sender's thread for that pair, which
    sends at once: a fetch goes through while the prefill replica's event loop is busy; only the
    release of the blocks and the ledger record wait for the loop."""
    sender_loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=sender_loop.run_forever, daemon=True)
    loop_thread.start()
    prefill = PrefillEngine(random_cache(1), array("q", bytes(8 * SHAPE[2])))
    sender = KvSender(prefill, "prefill", "gloo", TIMEOUT_S, Ledger(), node=NODE)
    asyncio.run_coroutine_threadsafe(sender.start(), sender_loop).result(TIMEOUT_S)
    busy, free = threading.Event(), threading.Event()

    def block_the_loop() -> None:
        busy.set()
        free.wait(TIMEOUT_S)

    async def main():
        receiver = KvReceiver(DecodeEngine(random_cache(2)), "decode", "gloo", TIMEOUT_S, node=NODE)
        assert (await receiver.fetch(lease_of(sender, "r1"), TARGET, ("r1",))).ok  # the pair opens
        assert await released(prefill, "r1")
        decode_cache = receiver.engine.kv_cache
        decode_cache.zero_()
        sender_loop.call_soon_threadsafe(block_the_loop)
        assert busy.wait(TIMEOUT_S)
        try:
            transfer = await asyncio.wait_for(receiver.fetch(lease_of(sender, "r2"), TARGET, ("r2",)), TIMEOUT_S / 2)
            assert transfer.ok and torch.equal(decode_cache, expected_target(prefill.kv_cache, torch.zeros(SHAPE)))
            assert prefill.released == ["r1"]
        finally:
            free.set()
        assert await released(prefill, "r2")
        assert [r.request_id for r in sender.ledger.records] == ["r1", "r2"]
        receiver.close()
        await pairs_closed()

    try:
        asyncio.run(main())
    finally:
        free.set()
        sender_loop.call_soon_threadsafe(sender.close)
        sender_loop.call_soon_threadsafe(sender_loop.stop)
        loop_thread.join(TIMEOUT_S)


def test_gloo_the_senders_pair_thread_ends_with_the_pair():
    """A failed fetch drops decode's pair; the sender's thread for it ends (none is left behind
    per failure) and the next fetch opens a new pair."""

    async def scenario(prefill, sender, receiver):
        assert (await receiver.fetch(lease_of(sender, "r1"), TARGET, ("r1",))).ok
        assert pair_threads() == 2  # prefill's, and decode's inbox
        misfit = dataclasses.replace(lease_of(sender, "misfit"), kv_dtype="bfloat16")
        failed = await receiver.fetch(misfit, TARGET, ("misfit",))
        assert not failed.ok and failed.reason == "transfer failed: ValueError"
        await pairs_closed()
        assert (await receiver.fetch(lease_of(sender, "r2"), TARGET, ("r2",))).ok
        assert sender.num_pairs == 2 and pair_threads() == 2

    run("gloo", scenario)


@pytest.fixture
def kv_file():
    path = str(SHM_DIR / f"pegaserve-test-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    cache, _ = map_kv_file(path, SHAPE, torch.float32, create=True)
    cache.copy_(random_cache(3))
    yield path
    os.unlink(path)


def test_shm_decode_copies_the_blocks_itself(kv_file):
    async def scenario(prefill, sender, receiver):
        decode_cache = receiver.engine.kv_cache
        expected = expected_target(prefill.kv_cache, decode_cache)
        transfer = await receiver.fetch(lease_of(sender, "r3"), TARGET, ("r3",))
        assert transfer.ok and transfer.transport == "shm"
        assert torch.equal(decode_cache, expected)
        assert await released(prefill, "r3")
        assert [r.request_id for r in sender.ledger.records] == ["r3"]

    run("shm", scenario, kv_file)


@pytest.mark.parametrize("fault", ["expired", "reused"])
def test_shm_a_lease_not_held_through_the_copy_is_recomputed(kv_file, fault):
    async def scenario(prefill, sender, receiver):
        lease = lease_of(sender, "r4", held_for_s=-1.0 if fault == "expired" else 60.0)
        if fault == "reused":
            prefill.kv_generations[PROMPT_BLOCKS[3]] += 1
        transfer = await receiver.fetch(lease, TARGET, ("r4",))
        assert not transfer.ok and transfer.reason == "lease expired or unknown"
        assert await released(prefill, "r4")
        assert sender.ledger.records == []
        assert (await receiver.fetch(lease_of(sender, "r5"), TARGET, ("r5",))).ok

    run("shm", scenario, kv_file)
