"""How the KV bytes move between a prefill and a decode replica.

`gloo` (CPU) uses torch.distributed's `ProcessGroupGloo` directly, one 2-rank group per pair, its
rendezvous a TCPStore that prefill opens and names in a `PairOffer` (Ray's gloo collective group
makes each process join a single default torch.distributed world, which would tie a replica to
one peer for life). `nccl` (GPUs) goes through `ray.util.collective` (cupy). `object_store`
packs the prompt into the Ray object store at prefill time; the lease carries the reference.

Pair channels block: callers run `send`/`recv` in a worker thread, one transfer at a time per
pair, in the order of their connection's messages.
"""

from __future__ import annotations

import datetime
import warnings
from abc import ABC, abstractmethod

import numpy as np
import ray
import torch


class PairChannel(ABC):
    """Prefill is rank 0 and sends; decode is rank 1 and receives."""

    @abstractmethod
    def send(self, tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def recv(self, tensor: torch.Tensor) -> None: ...


class GlooPair(PairChannel):
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

    def send(self, tensor: torch.Tensor) -> None:
        self._group.send([tensor], self._peer, 0).wait()

    def recv(self, tensor: torch.Tensor) -> None:
        self._group.recv([tensor], self._peer, 0).wait()


class NcclPair(PairChannel):
    def __init__(self, group_name: str, rank: int) -> None:
        from ray.util import collective  # noqa: PLC0415 - needs cupy, a GPU extra

        self._collective = collective
        self._name = group_name
        self._peer = 1 - rank
        collective.init_collective_group(2, rank, backend="nccl", group_name=group_name)

    def send(self, tensor: torch.Tensor) -> None:
        self._collective.send(tensor, self._peer, self._name)

    def recv(self, tensor: torch.Tensor) -> None:
        self._collective.recv(tensor, self._peer, self._name)


def kv_as_bytes(kv: torch.Tensor) -> np.ndarray:
    """The object store's form of packed KV: raw bytes in a numpy array, which Ray stores without
    pickling and maps zero-copy on get (a pickled torch tensor costs ~4x more; bf16 has no numpy dtype)."""
    return kv.detach().contiguous().cpu().view(torch.uint8).numpy()


def kv_from_bytes(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():  # the mapped array is read-only; the engine only copies from it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(data)
    return raw.view(getattr(torch, dtype)).reshape(shape)
