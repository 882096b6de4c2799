"""The pair channel's block moves (deployments/handoff/transports.py) over a real gloo pair on
127.0.0.1: the blocks land where decode asked, whichever way they travel — as slabs straight from
cache to cache when they lie in runs in both caches, packed layer by layer otherwise — and the
two sides cut a transfer into the same messages, transfer after transfer."""

import datetime
import threading

import pytest
import torch

from deployments.channel import Address
from deployments.handoff import transports
from deployments.handoff.protocol import Lease
from deployments.handoff.transports import GlooPair, Staging, slab_runs
from pegaserve.engine.request import ParkedKv

TIMEOUT_S = 30.0
LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 3, 4, 2, 8
BLOCK_BYTES = 2 * LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4  # fp32, K and V


def cache(num_blocks: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(LAYERS, 2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=generator)


@pytest.fixture(scope="module")
def pair() -> tuple[GlooPair, GlooPair]:
    store = torch.distributed.TCPStore("127.0.0.1", 0, 2, is_master=True,
                                       timeout=datetime.timedelta(seconds=TIMEOUT_S), wait_for_workers=False)
    joined = torch.distributed.TCPStore("127.0.0.1", store.port, 2, is_master=False,
                                        timeout=datetime.timedelta(seconds=TIMEOUT_S))
    sides: dict[int, GlooPair] = {}
    threads = [threading.Thread(target=lambda r, s: sides.__setitem__(r, GlooPair(s, r, TIMEOUT_S)), args=(r, s))
               for r, s in ((0, store), (1, joined))]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    return sides[0], sides[1]


def move(pair, source: torch.Tensor, source_ids: list[int], target: torch.Tensor, target_ids: list[int]) -> None:
    sender = threading.Thread(target=pair[0].send_blocks, args=(source, source_ids, target_ids, Staging()))
    sender.start()
    pair[1].recv_blocks(target, source_ids, target_ids, Staging())
    sender.join(TIMEOUT_S)
    assert not sender.is_alive()


@pytest.mark.parametrize(
    ("source_ids", "target_ids", "as_slabs"),
    [
        (list(range(3, 11)), list(range(20, 28)), True),  # one run in both caches
        ([9, 8, 7, 6, 1, 2, 3, 4], [5, 4, 3, 2, 10, 11, 12, 13], True),  # a falling run, then a rising one
        ([7, 3, 4, 5, 19, 0], [0, 29, 10, 11, 12, 6], False),  # scattered: packed layer by layer
        ([], [], True),
    ],
)
def test_blocks_land_where_decode_asked(pair, monkeypatch, source_ids, target_ids, as_slabs):
    monkeypatch.setattr(transports, "MIN_SLAB_BYTES", 4 * BLOCK_BYTES // (2 * LAYERS))  # runs of 4 blocks are slabs
    assert (slab_runs(cache(1, 0), source_ids, target_ids) is not None) == as_slabs
    source, target = cache(20, 1), cache(30, 2)
    expected = target.clone()
    expected[:, :, target_ids] = source[:, :, source_ids]
    move(pair, source, source_ids, target, target_ids)
    assert torch.equal(target, expected)


def test_slabs_below_the_threshold_travel_packed(pair):
    """The default threshold: a few small blocks are packed (fewer messages), a long run is not."""
    assert slab_runs(cache(1, 0), [1, 2], [5, 6]) is None
    many = transports.MIN_SLAB_BYTES * 2 * LAYERS // BLOCK_BYTES
    assert slab_runs(cache(1, 0), list(range(many)), list(range(many, 2 * many))) == [(0, many, many)]
    source, target = cache(2 * many, 3), cache(2 * many, 4)
    expected = target.clone()
    expected[:, :, many:] = source[:, :, :many]
    move(pair, source, list(range(many)), target, list(range(many, 2 * many)))
    assert torch.equal(target, expected)


def test_block_counts_must_agree():
    with pytest.raises(ValueError, match="3 blocks sent into 2"):
        slab_runs(cache(1, 0), [1, 2, 3], [4, 5])


def test_a_lease_fits_only_a_cache_of_its_layout():
    """Slabs are raw bytes: decode refuses (and recomputes) a prompt whose KV has another layout."""
    address = Address("127.0.0.1", 1, "token")
    lease = Lease("r", "prefill", address, (LAYERS, 2, 5, BLOCK_SIZE, KV_HEADS, HEAD_DIM), "float32", BLOCK_BYTES,
                  ParkedKv(tuple(range(5)), (0,) * 5, 0.0))
    shape = tuple(cache(30, 0).shape)
    assert lease.fits(shape, "float32")
    assert not lease.fits(shape, "bfloat16")
    assert not lease.fits((LAYERS + 1, *shape[1:]), "float32")
    assert not lease.fits((*shape[:3], BLOCK_SIZE * 2, *shape[4:]), "float32")


@pytest.mark.parametrize("posts_at_once", [True, False], ids=["posted-at-once", "posted-in-the-thread"])
@pytest.mark.parametrize("ok", [True, False])
def test_the_senders_verdict_comes_after_the_blocks(pair, monkeypatch, posts_at_once, ok):
    """send_with_verdict/start_recv: the blocks land, then the verdict the sender computed once they
    were read (a channel that cannot post at once, like nccl, receives it in order after them)."""
    monkeypatch.setattr(transports, "MIN_SLAB_BYTES", 4 * BLOCK_BYTES // (2 * LAYERS))
    for side in pair:
        monkeypatch.setattr(side, "posts_at_once", posts_at_once)
    for source_ids, target_ids in (([3, 4, 5, 6], [9, 10, 11, 12]), ([7, 3, 19], [0, 29, 10])):  # slabs, then packed
        source, target = cache(20, 5), cache(30, 6)
        expected = target.clone()
        expected[:, :, target_ids] = source[:, :, source_ids]
        read = []
        finish_recv = pair[1].start_recv(target, source_ids, target_ids, Staging())
        sender = threading.Thread(target=lambda: read.append(pair[0].send_with_verdict(
            source, source_ids, target_ids, Staging(), lambda: read.append(1) or ok)))
        sender.start()
        assert finish_recv() is ok
        sender.join(TIMEOUT_S)
        assert read == [1, ok] and torch.equal(target, expected)
