"""Pair channels: one 2-rank channel per prefill/decode pair, which moves a prompt's blocks from
prefill's cache straight into the blocks decode's engine reserved. A `PairTransport`
(pd/transports/base.py) opens them; what they run on is its own (pd/transports/).

Pair channels block: callers run them in a worker thread, one transfer at a time per pair, in the
order of their fetches (decode posts its receives before it sends the fetch, so the bytes flow the
moment prefill sends). Both sides cut a transfer into the same messages: where the blocks lie in
runs in both caches, each run of each layer's K or V is one contiguous slab sent straight from
prefill's cache into decode's, nothing packed; otherwise the blocks are packed layer by layer, a
layer travelling while the next is packed and unpacked while the next arrives. The last message is
the sender's verdict: whether what it read was still the prompt's KV.

On a channel that `carries_fetches` the fetch itself travels on the pair (`fetch_message`: binary,
with the cut decode chose), to a thread of the sender that waits for nothing else (`pull`,
`serve_fetch`); otherwise the fetch travels on the replicas' connection and each side finds the
runs itself (`start_recv`, `send_fetched`).
"""

from __future__ import annotations

import datetime
import enum
import functools
import pickle
import struct
import time
from abc import ABC, abstractmethod
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import numpy as np
import torch

from pegaserve.messages import ParkedKv
from pegaserve.pd.protocol import Fetch
from pegaserve.runner.model_runner import Run, block_runs, pack_layer, unpack_layer

# Below, a message's fixed cost outweighs the copies it saves: ~30 us posted from Python on a loopback
# pair, ~100 us after an idle spell; ~10 and ~25 us from C++ (a pair whose native side decides).
MIN_SLAB_BYTES = 256 << 10
NATIVE_MIN_SLAB_BYTES = 64 << 10
VERDICT_TAG = 1 << 20  # past any block message's tag
FETCH_TAG = VERDICT_TAG + 1
MAX_FETCH_BYTES = 4 << 20  # a `fetch_message`, ~27 bytes per block: a longer one fails and decode recomputes
_HEADER = struct.Struct("<qqqd")  # fetch_message's: length, runs, blocks, expiry
WORD_BYTES = 8
NO_TIMEOUT = datetime.timedelta(days=365)  # a pair idles for as long as no prompt is handed over


class _Find(enum.Enum):
    FIND = "find"


FIND: Final = _Find.FIND  # the runs as `slab_runs` finds them
Runs = list[Run] | None | _Find  # slabs of these runs, packed (None), or FIND


def _runs(runs: Runs, cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int]) -> list[Run] | None:
    return slab_runs(cache, source_ids, target_ids) if runs is FIND else runs


class Work(Protocol):
    def wait(self, timeout: datetime.timedelta = ...) -> object: ...


class Done:
    """A blocking channel's handle: the transfer is over when it is returned."""

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        return None


class PairChannel(ABC):
    """Prefill is rank 0 and sends; decode is rank 1 and receives. Messages of one transfer carry
    distinct tags; each side waits for all of them before the next transfer."""

    posts_at_once = False  # whether post_recv returns at once, the bytes landing from the channel's own threads
    carries_fetches = False  # whether the fetch travels on the pair itself (`pull`/`serve_fetch`)

    @abstractmethod
    def post_send(self, tensor: torch.Tensor, tag: int) -> Work: ...

    @abstractmethod
    def post_recv(self, tensor: torch.Tensor, tag: int) -> Work: ...

    def close(self) -> None:
        """Leave the pair (nothing may be in flight on it): the peer's waits on it end."""

    def send_with_verdict(self, cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int],
                          staging: Staging, verdict: Callable[[], bool], runs: Runs = FIND, tags: int = 0) -> bool:
        """`send_blocks`, then `verdict()` — were the bytes it read the prompt's? — as the transfer's
        last message; returns it. Blocks (a worker thread's): a send posted after its receive
        writes the bytes in the caller's thread. `tags`: where this transfer's tags start (a push's
        are apart from a fetch's: both may be under way on one pair)."""
        self.send_blocks(cache, source_ids, target_ids, staging, runs, tags)
        ok = verdict()
        flag = staging.flag(cache.device)
        flag.fill_(int(ok))
        self.post_send(flag, tags + VERDICT_TAG).wait()
        return ok

    def start_recv(self, cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int],
                   staging: Staging, runs: Runs = FIND, tags: int = 0) -> Callable[[], bool]:
        """`send_with_verdict`'s other side: posts the receives now where the channel can (`posts_at_once`), so
        the bytes flow as soon as the peer sends, before any thread is scheduled here, and returns
        the rest, which blocks (for a worker thread) and returns the sender's verdict."""
        flag = staging.flag(cache.device)
        if self.posts_at_once:
            finish = self._post_recvs(cache, source_ids, target_ids, staging, runs, tags)
            flag_work = self.post_recv(flag, tags + VERDICT_TAG)
        else:  # posting blocks: all of it in the thread, the verdict after the blocks (matched in order)
            finish = functools.partial(self.recv_blocks, cache, source_ids, target_ids, staging, runs, tags)
            flag_work = None

        def rest() -> bool:
            finish()
            (flag_work or self.post_recv(flag, tags + VERDICT_TAG)).wait()
            return bool(flag.item())

        return rest

    def pull(self, cache: torch.Tensor, fetch: Fetch, staging: Staging, runs: Runs = FIND) -> Callable[[], bool]:
        """Decode, on a channel that `carries_fetches`: sends the fetch (first, so the sender wakes
        meanwhile: a send waits for its receive), then posts the receives of the fetch's blocks and
        of the verdict; the fetch says how the blocks travel (`runs`). Returns the rest, which
        blocks (for a worker thread) and returns the sender's verdict."""
        runs = _runs(runs, cache, fetch.source_block_ids, fetch.target_block_ids)
        asked = self.post_send(fetch_message(fetch, runs), FETCH_TAG)
        finish = self.start_recv(cache, fetch.source_block_ids, fetch.target_block_ids, staging, runs)
        return functools.partial(_after, asked, finish)

    def serve_fetch(self, cache: torch.Tensor, generations: Sequence[int], buffer: torch.Tensor, staging: Staging,
                    delay_s: float = 0.0) -> Served:
        """Prefill, in a thread of the pair's own: waits for the next fetch (raises once the peer
        closed the pair) into `buffer` (`MAX_FETCH_BYTES` of uint8), sends its blocks as decode cut
        them (after `delay_s`, a test's fault) and the verdict (`generations`: the live blocks'). A
        failure after the fetch came leaves it readable by `fetch_in(buffer)`."""
        buffer[:WORD_BYTES].zero_()
        self.post_recv(buffer, FETCH_TAG).wait(NO_TIMEOUT)
        fetch, runs = read_fetch(buffer)
        return self.send_fetched(cache, generations, fetch, staging, delay_s, runs)

    def send_fetched(self, cache: torch.Tensor, generations: Sequence[int], fetch: Fetch, staging: Staging,
                     delay_s: float = 0.0, runs: Runs = FIND) -> Served:
        """Send a fetch's blocks (after `delay_s`, a test's fault) and, once they are read, whether
        they were the prompt's KV (`generations`: the live blocks'), as the transfer's last message:
        the bytes always travel, so the pair stays in step whatever the verdict."""
        start = time.perf_counter()
        if delay_s:
            time.sleep(delay_s)
        held = self.send_with_verdict(
            cache, fetch.source_block_ids, fetch.target_block_ids, staging,
            lambda: fetch.parked.intact(fetch.source_block_ids, generations, time.monotonic()), runs)
        return Served(fetch, held, time.perf_counter() - start)

    def send_blocks(self, cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int],
                    staging: Staging, runs: Runs = FIND, tags: int = 0) -> None:
        """Send `cache[:, :, source_ids]` to the peer's `recv_blocks` into its `target_ids` (as slabs
        of `runs`, or packed where they are None; by default as `slab_runs` finds them)."""
        runs = _runs(runs, cache, source_ids, target_ids)
        if runs is not None:
            works = [self.post_send(slab, tags + tag) for tag, slab in enumerate(_slabs(cache, runs, side=0))]
        else:
            index = torch.tensor(list(source_ids), device=cache.device)
            buffer = staging.take(packed_shape(cache, len(index)), cache.dtype, cache.device)
            works = []  # each layer travels while the next is packed
            for layer in range(cache.shape[0]):
                pack_layer(cache, layer, index, buffer[layer])
                works.append(self.post_send(buffer[layer], tags + layer))
        _wait_all(works)

    def recv_blocks(self, cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int],
                    staging: Staging, runs: Runs = FIND, tags: int = 0) -> None:
        """Receive the peer's `send_blocks` into `cache[:, :, target_ids]`."""
        self._post_recvs(cache, source_ids, target_ids, staging, runs, tags)()

    def _post_recvs(self, cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int],
                    staging: Staging, runs: Runs, tags: int = 0) -> Callable[[], None]:
        """Post `recv_blocks`'s receives; returns the rest: wait for them (unpacking packed layers)."""
        runs = _runs(runs, cache, source_ids, target_ids)
        if runs is not None:
            works = [self.post_recv(slab, tags + tag) for tag, slab in enumerate(_slabs(cache, runs, side=1))]
            return functools.partial(_wait_all, works)
        index = torch.tensor(list(target_ids), device=cache.device)
        buffer = staging.take(packed_shape(cache, len(index)), cache.dtype, cache.device)
        works = [self.post_recv(buffer[layer], tags + layer) for layer in range(cache.shape[0])]

        def unpack() -> None:  # each layer unpacked while the next arrives
            for layer, work in enumerate(works):
                work.wait()
                unpack_layer(cache, layer, index, buffer[layer])

        return unpack


@dataclass(frozen=True)
class Served:
    """A fetch a pair's sender served: whether the blocks it sent were the prompt's, and how long
    it took from the fetch's arrival to the verdict's send."""

    fetch: Fetch
    held: bool
    seconds: float


def fetch_message(fetch: Fetch, runs: list[Run] | None) -> torch.Tensor:
    """A fetch as it travels on a pair, read by both sides' code (a native side's too): a header
    (the message's length in bytes, the number of runs — -1: the blocks travel packed —, of blocks,
    and the lease's expiry, a double), int64 words — per run (source block, target block, blocks),
    then the source ids, the target ids, and the generations the source blocks parked with (-1: not
    the lease's) — and last the pickled request id and choice ids, for prefill's bookkeeping."""
    source, parked = fetch.source_block_ids, fetch.parked
    first = len(parked.block_ids) - len(source)
    if parked.block_ids[first:] == tuple(source):  # the usual: the lease's last blocks
        generations = parked.generations[first:]
    else:
        expected = dict(zip(parked.block_ids, parked.generations))
        generations = [expected.get(block, -1) for block in source]
    words = array("q", [w for run in runs or () for w in run])
    for column in (source, fetch.target_block_ids, generations):
        words.extend(column)
    tail = pickle.dumps((fetch.request_id, fetch.choice_ids), protocol=pickle.HIGHEST_PROTOCOL)
    length = _HEADER.size + words.itemsize * len(words) + len(tail)
    if length > MAX_FETCH_BYTES:
        raise ValueError(f"a fetch of {length} bytes (at most {MAX_FETCH_BYTES})")
    header = _HEADER.pack(length, -1 if runs is None else len(runs), len(source), parked.held_until)
    return torch.frombuffer(bytearray(header + words.tobytes() + tail), dtype=torch.uint8)


def read_fetch(buffer: torch.Tensor) -> tuple[Fetch, list[Run] | None]:
    """`fetch_message`'s fetch and runs, from the start of `buffer` (the fetch's lease narrowed to
    its blocks: all a sender needs)."""
    raw = buffer.numpy()
    length, num_runs, num_blocks, held_until = _HEADER.unpack_from(raw)
    run_words = 3 * max(num_runs, 0)
    words = run_words + 3 * num_blocks
    if num_blocks < 0 or not _HEADER.size + WORD_BYTES * words <= length <= len(raw):
        raise ValueError(f"a malformed fetch ({length} bytes, {num_runs} runs, {num_blocks} blocks)")
    body = np.frombuffer(raw, dtype=np.int64, count=words, offset=_HEADER.size).tolist()
    runs = None if num_runs < 0 else [tuple(body[i : i + 3]) for i in range(0, run_words, 3)]
    source, target, generations = (tuple(body[run_words + k * num_blocks : run_words + (k + 1) * num_blocks])
                                   for k in range(3))
    request_id, choice_ids = pickle.loads(raw[_HEADER.size + WORD_BYTES * words : length].tobytes())
    return Fetch(request_id, choice_ids, ParkedKv(source, generations, held_until), source, target), runs


def fetch_in(buffer: torch.Tensor) -> Fetch | None:
    """The fetch a failed `serve_fetch` was serving, if one had come."""
    try:
        return read_fetch(buffer)[0] if _HEADER.unpack_from(buffer.numpy())[0] else None
    except Exception:  # a fetch cut short by the failure: nothing to tell
        return None


def _after(first: Work, then: Callable[[], bool]) -> bool:
    first.wait()
    return then()


def _wait_all(works: list[Work]) -> None:
    for work in works:
        work.wait()


def slab_runs(cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int],
              min_slab_bytes: int | None = None) -> list[Run] | None:
    """The runs the blocks lie in in both caches, when they are long enough to travel as slabs
    (`min_slab_bytes` on average; default `MIN_SLAB_BYTES`)."""
    if len(source_ids) != len(target_ids):
        raise ValueError(f"{len(source_ids)} blocks sent into {len(target_ids)}")
    if not source_ids:
        return []
    runs = list(block_runs(list(source_ids), list(target_ids)))
    slab_bytes = len(source_ids) * block_bytes(cache) // (cache.shape[0] * 2 * len(runs))
    return runs if slab_bytes >= (MIN_SLAB_BYTES if min_slab_bytes is None else min_slab_bytes) else None


def block_bytes(cache: torch.Tensor) -> int:
    """One block across every layer, K and V (from the shape: indexing the tensor costs ~10 us)."""
    return cache.numel() // cache.shape[2] * cache.element_size()


def _slabs(cache: torch.Tensor, runs: list[Run], side: int) -> Iterator[torch.Tensor]:
    """Per run, per layer, K then V: the run's blocks, contiguous (`side` 0: source ids, 1: target)."""
    flat = cache.view(cache.shape[0] * 2, cache.shape[2], -1)  # [layers * 2, num_blocks, block elements]
    for run in runs:
        first, width = run[side], run[2]
        for slab in range(flat.shape[0]):
            yield flat[slab, first : first + width]


def packed_shape(cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
    """`num_blocks` of `cache` packed: [layers, 2, num_blocks, block_size, kv_heads, head_dim]."""
    return (cache.shape[0], 2, num_blocks, *cache.shape[3:])


class Staging:
    """One pair's reusable staging buffer, and its verdict's: a transfer of a size seen before touches
    no new page (the pair's transfers follow one another, so one buffer serves them all)."""

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None
        self._flag: torch.Tensor | None = None

    def flag(self, device: torch.device) -> torch.Tensor:
        """The one int32 of a verdict."""
        if self._flag is None or self._flag.device != device:
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        return self._flag

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        storage = self._storage
        if storage is None or storage.numel() < numel or storage.dtype != dtype or storage.device != device:
            storage = self._storage = torch.empty(numel, dtype=dtype, device=device)
        return storage[:numel].view(shape)
