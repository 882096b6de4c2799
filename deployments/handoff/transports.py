"""How the KV bytes move between a prefill and a decode replica.

`gloo` (CPU) uses torch.distributed's `ProcessGroupGloo` directly, one 2-rank group per pair, its
rendezvous a TCPStore that prefill opens and names in a `PairOffer` (Ray's gloo collective group
makes each process join a single default torch.distributed world, which would tie a replica to
one peer for life). `nccl` (GPUs) goes through `ray.util.collective` (cupy). `object_store`
packs the prompt into the Ray object store at prefill time; the lease carries the reference.

Pair channels block: callers run them in a worker thread, one transfer at a time per pair, in the
order of their connection's messages. A transfer moves the prompt's KV layer by layer: gloo sends a
layer while the next is packed, and the receiver unpacks a layer while the next arrives.
"""

from __future__ import annotations

import datetime
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable

import numpy as np
import ray
import torch

Layer = Callable[[int, torch.Tensor], None]  # (layer, that layer's part of the buffer)


class PairChannel(ABC):
    """Prefill is rank 0 and sends; decode is rank 1 and receives."""

    @abstractmethod
    def send(self, tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def recv(self, tensor: torch.Tensor) -> None: ...

    def send_layers(self, buffer: torch.Tensor, pack: Layer) -> None:
        """Send `buffer` ([layers, ...], contiguous), each layer filled by `pack` first."""
        for layer in range(buffer.shape[0]):
            pack(layer, buffer[layer])
        self.send(buffer)

    def recv_layers(self, buffer: torch.Tensor, unpack: Layer) -> None:
        """Receive into `buffer` ([layers, ...], contiguous), handing each layer to `unpack`."""
        self.recv(buffer)
        for layer in range(buffer.shape[0]):
            unpack(layer, buffer[layer])


class Staging:
    """One pair's reusable staging buffer: a transfer of a size seen before touches no new page."""

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = 1
        for n in shape:
            numel *= n
        storage = self._storage
        if storage is None or storage.numel() < numel or storage.dtype != dtype or storage.device != device:
            storage = self._storage = torch.empty(numel, dtype=dtype, device=device)
        return storage[:numel].view(shape)


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

    def send_layers(self, buffer: torch.Tensor, pack: Layer) -> None:
        works = []  # gloo sends each layer from its own threads while this one packs the next
        for layer in range(buffer.shape[0]):
            pack(layer, buffer[layer])
            works.append(self._group.send([buffer[layer]], self._peer, layer))
        for work in works:
            work.wait()

    def recv_layers(self, buffer: torch.Tensor, unpack: Layer) -> None:
        works = [self._group.recv([buffer[layer]], self._peer, layer) for layer in range(buffer.shape[0])]
        for layer, work in enumerate(works):
            work.wait()
            unpack(layer, buffer[layer])


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
