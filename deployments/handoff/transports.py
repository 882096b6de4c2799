"""How the KV bytes move between a prefill and a decode replica.

`gloo` (CPU) uses torch.distributed's `ProcessGroupGloo` directly, one 2-rank group per pair, its
rendezvous a TCPStore that prefill opens and names in a `PairOffer` (Ray's gloo collective group
makes each process join a single default torch.distributed world, which would tie a replica to
one peer for life). `nccl` (GPUs) goes through `ray.util.collective` (cupy). `object_store`
packs the prompt into the Ray object store at prefill time; the lease carries the reference.

Pair channels block: callers run them in a worker thread, one transfer at a time per pair, in the
order of their fetches (decode posts its receives before it sends the fetch, so the bytes flow the
moment prefill sends). On gloo the fetch itself travels on the pair, to a thread of the sender that
waits for nothing else; on nccl it travels on the replicas' connection. Both sides know both block
lists (the fetch names them), so they cut a transfer into the same messages: where the blocks lie
in runs in both caches, each run of each layer's K or V is one contiguous slab sent straight from
prefill's cache into decode's, nothing packed; otherwise the blocks are packed layer by layer, a
layer travelling while the next is packed and unpacked while the next arrives. The last message is
the sender's verdict: whether what it read was still the prompt's KV.
"""

from __future__ import annotations

import datetime
import functools
import struct
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

import numpy as np
import ray
import torch

from pegaserve.engine.runner import Run, block_runs, pack_layer, unpack_layer

MIN_SLAB_BYTES = 256 << 10  # below, a message's fixed cost (~30 us on loopback gloo) outweighs the copies it saves
_VERDICT_TAG = 1 << 20  # past any block message's tag
_FETCH_TAG = _VERDICT_TAG + 1
MAX_FETCH_BYTES = 4 << 20  # a pickled `Fetch`, ~11 bytes per block: a longer one fails and decode recomputes
_LENGTH = struct.Struct("<q")
_NO_TIMEOUT = datetime.timedelta(days=365)  # a pair idles for as long as no prompt is handed over


class Work(Protocol):
    def wait(self, timeout: datetime.timedelta = ...) -> object: ...


class _Done:
    """A blocking transport's handle: the transfer is over when it is returned."""

    def wait(self, timeout: datetime.timedelta | None = None) -> None:
        return None


class PairChannel(ABC):
    """Prefill is rank 0 and sends; decode is rank 1 and receives. Messages of one transfer carry
    distinct tags; each side waits for all of them before the next transfer."""

    posts_at_once = False  # whether post_recv returns at once, the bytes landing from the channel's own threads
    carries_fetches = False  # whether the fetch travels on the pair itself (`post_fetch`/`recv_fetch`)

    @abstractmethod
    def post_send(self, tensor: torch.Tensor, tag: int) -> Work: ...

    @abstractmethod
    def post_recv(self, tensor: torch.Tensor, tag: int) -> Work: ...

    def close(self) -> None:
        """Leave the pair (nothing may be in flight on it): the peer's waits on it end."""

    def send_with_verdict(self, cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int],
                          staging: Staging, verdict: Callable[[], bool]) -> bool:
        """`send_blocks`, then `verdict()` — were the bytes it read the prompt's? — as the transfer's
        last message; returns it. Blocks (a worker thread's): a send posted after its receive
        writes the bytes in the caller's thread."""
        self.send_blocks(cache, source_ids, target_ids, staging)
        ok = verdict()
        flag = staging.flag(cache.device)
        flag.fill_(int(ok))
        self.post_send(flag, _VERDICT_TAG).wait()
        return ok

    def start_recv(self, cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int],
                   staging: Staging) -> Callable[[], bool]:
        """`send_with_verdict`'s other side: posts the receives now where the channel can (gloo), so
        the bytes flow as soon as the peer sends, before any thread is scheduled here, and returns
        the rest, which blocks (for a worker thread) and returns the sender's verdict."""
        flag = staging.flag(cache.device)
        if self.posts_at_once:
            finish = self._post_recvs(cache, source_ids, target_ids, staging)
            flag_work = self.post_recv(flag, _VERDICT_TAG)
        else:  # posting blocks: all of it in the thread, the verdict after the blocks (matched in order)
            finish = functools.partial(self.recv_blocks, cache, source_ids, target_ids, staging)
            flag_work = None

        def rest() -> bool:
            finish()
            (flag_work or self.post_recv(flag, _VERDICT_TAG)).wait()
            return bool(flag.item())

        return rest

    def post_fetch(self, fetch: bytes) -> Work:
        """Decode: a pickled fetch to the sender's `recv_fetch`, one message, posted (the channel's
        threads send it; wait for the work before the transfer counts as over)."""
        if len(fetch) + _LENGTH.size > MAX_FETCH_BYTES:
            raise ValueError(f"a fetch of {len(fetch)} bytes (at most {MAX_FETCH_BYTES - _LENGTH.size})")
        message = torch.frombuffer(bytearray(_LENGTH.pack(len(fetch)) + fetch), dtype=torch.uint8)
        return self.post_send(message, _FETCH_TAG)

    def recv_fetch(self, buffer: torch.Tensor) -> bytes:
        """Prefill: the next pickled fetch, received into `buffer` (`MAX_FETCH_BYTES` of uint8; a
        message shorter than the buffer fills its start). Blocks until one comes; raises once the
        peer closed the pair."""
        self.post_recv(buffer, _FETCH_TAG).wait(_NO_TIMEOUT)
        raw = buffer.numpy()
        (length,) = _LENGTH.unpack_from(raw)
        return raw[_LENGTH.size : _LENGTH.size + length].tobytes()

    def send_blocks(self, cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int],
                    staging: Staging) -> None:
        """Send `cache[:, :, source_ids]` to the peer's `recv_blocks` into its `target_ids`."""
        runs = slab_runs(cache, source_ids, target_ids)
        if runs is not None:
            works = [self.post_send(slab, tag) for tag, slab in enumerate(_slabs(cache, runs, side=0))]
        else:
            index = torch.tensor(list(source_ids), device=cache.device)
            buffer = staging.take(packed_shape(cache, len(index)), cache.dtype, cache.device)
            works = []  # each layer travels while the next is packed
            for layer in range(cache.shape[0]):
                pack_layer(cache, layer, index, buffer[layer])
                works.append(self.post_send(buffer[layer], layer))
        _wait_all(works)

    def recv_blocks(self, cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int],
                    staging: Staging) -> None:
        """Receive the peer's `send_blocks` into `cache[:, :, target_ids]`."""
        self._post_recvs(cache, source_ids, target_ids, staging)()

    def _post_recvs(self, cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int],
                    staging: Staging) -> Callable[[], None]:
        """Post `recv_blocks`'s receives; returns the rest: wait for them (unpacking packed layers)."""
        runs = slab_runs(cache, source_ids, target_ids)
        if runs is not None:
            works = [self.post_recv(slab, tag) for tag, slab in enumerate(_slabs(cache, runs, side=1))]
            return functools.partial(_wait_all, works)
        index = torch.tensor(list(target_ids), device=cache.device)
        buffer = staging.take(packed_shape(cache, len(index)), cache.dtype, cache.device)
        works = [self.post_recv(buffer[layer], layer) for layer in range(cache.shape[0])]

        def unpack() -> None:  # each layer unpacked while the next arrives
            for layer, work in enumerate(works):
                work.wait()
                unpack_layer(cache, layer, index, buffer[layer])

        return unpack


def _wait_all(works: list[Work]) -> None:
    for work in works:
        work.wait()


def slab_runs(cache: torch.Tensor, source_ids: Sequence[int], target_ids: Sequence[int]) -> list[Run] | None:
    """The runs the blocks lie in in both caches, when they are long enough to travel as slabs."""
    if len(source_ids) != len(target_ids):
        raise ValueError(f"{len(source_ids)} blocks sent into {len(target_ids)}")
    if not source_ids:
        return []
    runs = list(block_runs(list(source_ids), list(target_ids)))
    slab_bytes = len(source_ids) * block_bytes(cache) // (cache.shape[0] * 2 * len(runs))
    return runs if slab_bytes >= MIN_SLAB_BYTES else None


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


class GlooPair(PairChannel):
    posts_at_once = True
    carries_fetches = True  # a receive shorter than its buffer is fine on gloo; the peer's end ends a wait

    def __init__(self, store: torch.distributed.TCPStore, rank: int, timeout_s: float) -> None:
        self._store = store  # the group keeps using it
        self._peer = 1 - rank
        self._group = torch.distributed.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))

    @staticmethod
    def offer(timeout_s: float) -> torch.distributed.TCPStore:
        """Prefill: the rendezvous, listening on this node's address (its port goes in a PairOffer)."""
        return torch.distributed.TCPStore(ray.util.get_node_ip_address(), 0, 2, is_master=True,
                                          timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)

    @staticmethod
    def join(host: str, port: int, timeout_s: float) -> torch.distributed.TCPStore:
        return torch.distributed.TCPStore(host, port, 2, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))

    def close(self) -> None:
        self._group = None  # the last reference: the group closes its connection to the peer

    def send(self, tensor: torch.Tensor) -> None:
        self.post_send(tensor, 0).wait()

    def recv(self, tensor: torch.Tensor) -> None:
        self.post_recv(tensor, 0).wait()

    def post_send(self, tensor: torch.Tensor, tag: int) -> Work:
        return self._group.send([tensor], self._peer, tag)  # gloo sends it from its own threads

    def post_recv(self, tensor: torch.Tensor, tag: int) -> Work:
        return self._group.recv([tensor], self._peer, tag)


class NcclPair(PairChannel):
    def __init__(self, group_name: str, rank: int) -> None:
        from ray.util import collective  # noqa: PLC0415 - needs cupy, a GPU extra

        self._collective = collective
        self._name = group_name
        self._peer = 1 - rank
        collective.init_collective_group(2, rank, backend="nccl", group_name=group_name)

    def post_send(self, tensor: torch.Tensor, tag: int) -> Work:
        self._collective.send(tensor, self._peer, self._name)  # in order, so the tag is not needed
        return _Done()

    def post_recv(self, tensor: torch.Tensor, tag: int) -> Work:
        self._collective.recv(tensor, self._peer, self._name)
        return _Done()


def kv_as_bytes(kv: torch.Tensor) -> np.ndarray:
    """The object store's form of packed KV: raw bytes in a numpy array, which Ray stores without
    pickling and maps zero-copy on get (a pickled torch tensor costs ~4x more; bf16 has no numpy dtype)."""
    return kv.detach().contiguous().cpu().view(torch.uint8).numpy()


def kv_from_bytes(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():  # the mapped array is read-only; the engine only copies from it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(data)
    return raw.view(getattr(torch, dtype)).reshape(shape)
