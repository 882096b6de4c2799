"""The pair channel's block moves (pegaserve/pd/pair_channel.py) over a real gloo pair on
127.0.0.1: the blocks land where decode asked, whichever way they travel — as slabs straight from
cache to cache when they lie in runs in both caches, packed layer by layer otherwise — and the
two sides cut a transfer into the same messages, transfer after transfer."""

import datetime
import threading
from array import array

import pytest
import torch

from pegaserve.messages import ParkedKv
from pegaserve.net.channel import Address
from pegaserve.pd import pair_channel as transports
from pegaserve.pd.pair_channel import Staging, slab_runs
from pegaserve.pd.protocol import Fetch, Lease
from pegaserve.pd.transports import native
from pegaserve.pd.transports.gloo import GlooPair

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


def test_the_native_side_builds():
    """csrc/gloo_pair.cpp builds on these machines (`make model` builds it ahead): where it would
    not, the pairs run the Python protocol and every test below checks that one only."""
    assert native.module() is not None


@pytest.mark.parametrize(("source_ids", "runs"), [
    (tuple(range(3, 11)), [(3, 20, 8)]),
    ((7, 3, 19), None),  # packed
    ((), []),
])
def test_a_fetch_message_reads_back_as_sent(source_ids, runs):
    """The fetch's binary form: the runs decode chose, its blocks, and the lease narrowed to them
    (a source block the lease lacks gets generation -1, which no block ever has)."""
    parked = ParkedKv((1, 2, *source_ids), tuple(range(100, 102 + len(source_ids))), 1234.5)
    target_ids = tuple(range(20, 20 + len(source_ids)))
    fetch = Fetch("req", ("req-0", "req-1"), parked, source_ids, target_ids)
    read, read_runs = transports.read_fetch(transports.fetch_message(fetch, runs))
    assert read_runs == runs
    assert (read.request_id, read.choice_ids, read.source_block_ids, read.target_block_ids) == \
        ("req", ("req-0", "req-1"), source_ids, target_ids)
    assert read.parked == ParkedKv(source_ids, parked.generations[2:], 1234.5)
    stray = Fetch("req", ("req",), parked, (99, *source_ids[:1]), (0, *target_ids[:1]))
    assert transports.read_fetch(transports.fetch_message(stray, None))[0].parked.generations == \
        (-1, *parked.generations[2:3])


def test_a_failed_send_leaves_its_fetch_readable():
    buffer = torch.zeros(transports.MAX_FETCH_BYTES, dtype=torch.uint8)
    assert transports.fetch_in(buffer) is None  # nothing came: the peer closed the pair
    fetch = Fetch("req", ("req",), ParkedKv((4, 5), (1, 1), 9.0), (4, 5), (6, 7))
    message = transports.fetch_message(fetch, None)
    buffer[: len(message)] = message
    assert transports.fetch_in(buffer).request_id == "req"


@pytest.mark.parametrize("prefill_native", [True, False], ids=["prefill-native", "prefill-python"])
@pytest.mark.parametrize("decode_native", [True, False], ids=["decode-native", "decode-python"])
def test_pull_and_serve_fetch_agree_whichever_side_is_native(pair, monkeypatch, prefill_native, decode_native):
    """A fetch on the pair, C++ or Python at either end: the blocks land where decode asked (as
    slabs or packed), and the verdict is the lease's — held, a block handed out anew, the lease
    run out — on both sides."""
    module = native.module()
    monkeypatch.setattr(pair[0], "_native", module if prefill_native else None)
    monkeypatch.setattr(pair[1], "_native", module if decode_native else None)
    generations = array("q", [3] * 20)
    buffer = torch.empty(transports.MAX_FETCH_BYTES, dtype=torch.uint8)
    slab_of_4 = 4 * BLOCK_BYTES // (2 * LAYERS)  # runs of 4 blocks are slabs, whoever decides
    monkeypatch.setattr(transports, "MIN_SLAB_BYTES", slab_of_4)
    monkeypatch.setattr(transports, "NATIVE_MIN_SLAB_BYTES", slab_of_4)
    cases = [  # (source ids, target ids, lease's generations, expiry, verdict)
        (list(range(2, 18)), list(range(10, 26)), 3, 1e9, True),  # one run: slabs
        ([9, 8, 7, 6, 1, 2, 3, 4], [5, 4, 3, 2, 10, 11, 12, 13], 3, 1e9, True),  # two runs: slabs
        ([7, 3, 19], [0, 29, 10], 3, 1e9, True),  # scattered: packed
        (list(range(2, 18)), list(range(10, 26)), 2, 1e9, False),  # handed out anew since it parked
        (list(range(2, 18)), list(range(10, 26)), 3, 0.0, False),  # the lease ran out
        ([7, 3, 19], [0, 29, 10], 2, 1e9, False),
        ([7, 3, 19], [0, 29, 10], 3, 0.0, False),
    ]
    for source_ids, target_ids, parked_generation, expiry, verdict in cases:
        source, target = cache(20, 7), cache(30, 8)
        expected = target.clone()
        expected[:, :, target_ids] = source[:, :, source_ids]
        parked = ParkedKv(tuple(source_ids), (parked_generation,) * len(source_ids), expiry)
        fetch = Fetch("req", ("req",), parked, tuple(source_ids), tuple(target_ids))
        served: list[transports.Served] = []
        sender = threading.Thread(target=lambda out, blocks: out.append(
            pair[0].serve_fetch(blocks, generations, buffer, Staging())), args=(served, source))
        sender.start()
        assert pair[1].pull(target, fetch, Staging())() is verdict
        sender.join(TIMEOUT_S)
        assert torch.equal(target, expected)  # the bytes always travel: the pair stays in step
        assert served[0].fetch == fetch and served[0].held is verdict and served[0].seconds > 0


def test_send_fetched_is_the_nccl_sides_send(pair):
    """A fetch that came on the replicas' connection (nccl's way): each side finds the runs itself,
    the sender waits out its fault delay, then sends the blocks and the lease's verdict."""
    source_ids, target_ids = [3, 4, 5, 6], [9, 10, 11, 12]
    source, target = cache(20, 9), cache(30, 10)
    expected = target.clone()
    expected[:, :, target_ids] = source[:, :, source_ids]
    for generation, verdict in ((3, True), (4, False)):
        fetch = Fetch("req", ("req",), ParkedKv(tuple(source_ids), (generation,) * 4, 1e9), tuple(source_ids),
                      tuple(target_ids))
        finish = pair[1].start_recv(target, source_ids, target_ids, Staging())
        served: list[transports.Served] = []
        sender = threading.Thread(target=lambda out, f: out.append(
            pair[0].send_fetched(source, array("q", [3] * 20), f, Staging(), delay_s=0.05)), args=(served, fetch))
        sender.start()
        assert finish() is verdict
        sender.join(TIMEOUT_S)
        assert torch.equal(target, expected) and served[0].held is verdict and served[0].seconds >= 0.05
