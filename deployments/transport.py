"""KV transports: 2-rank channels, one per prefill/decode pair, opened lazily by both sides.

`nccl` goes through `ray.util.collective` (cupy). `gloo` uses torch.distributed's
`ProcessGroupGloo` directly, one group per pair: Ray's gloo collective group makes each process
join a single default torch.distributed world, which would tie a replica to one peer for life.
Rendezvous goes through Ray's internal KV in both cases. Every call here blocks: callers run it
in a worker thread, in an order both sides agree on.
"""

from __future__ import annotations

import datetime
import time
from abc import ABC, abstractmethod

import ray
import torch
from ray.experimental import internal_kv


class PairChannel(ABC):
    """Prefill is rank 0 and sends; decode is rank 1 and receives."""

    @abstractmethod
    def send(self, tensor: torch.Tensor) -> None: ...

    @abstractmethod
    def recv(self, tensor: torch.Tensor) -> None: ...

    def close(self) -> None:
        pass


class GlooPair(PairChannel):
    def __init__(self, group_name: str, rank: int, timeout_s: float) -> None:
        key = f"pegaserve-gloo-{group_name}"
        timeout = datetime.timedelta(seconds=timeout_s)
        if rank == 0:
            host = ray.util.get_node_ip_address()
            store = torch.distributed.TCPStore(host, 0, 2, is_master=True, timeout=timeout, wait_for_workers=False)
            internal_kv._internal_kv_put(key, f"{host}:{store.port}", overwrite=True)
        else:
            host, port = _wait_for_address(key, timeout_s).split(":")
            store = torch.distributed.TCPStore(host, int(port), 2, is_master=False, timeout=timeout)
        self._store = store  # the group keeps using it
        self._peer = 1 - rank
        self._group = torch.distributed.ProcessGroupGloo(store, rank, 2, timeout)

    def send(self, tensor: torch.Tensor) -> None:
        self._group.send([tensor], self._peer, 0).wait()

    def recv(self, tensor: torch.Tensor) -> None:
        self._group.recv([tensor], self._peer, 0).wait()


class NcclPair(PairChannel):
    def __init__(self, group_name: str, rank: int, timeout_s: float) -> None:
        from ray.util import collective  # noqa: PLC0415 - needs cupy, a GPU extra

        self._collective = collective
        self._name = group_name
        self._peer = 1 - rank
        collective.init_collective_group(2, rank, backend="nccl", group_name=group_name)

    def send(self, tensor: torch.Tensor) -> None:
        self._collective.send(tensor, self._peer, self._name)

    def recv(self, tensor: torch.Tensor) -> None:
        self._collective.recv(tensor, self._peer, self._name)

    def close(self) -> None:
        self._collective.destroy_collective_group(self._name)


def open_pair(transport: str, group_name: str, rank: int, timeout_s: float) -> PairChannel:
    if transport == "gloo":
        return GlooPair(group_name, rank, timeout_s)
    if transport == "nccl":
        return NcclPair(group_name, rank, timeout_s)
    raise ValueError(f"{transport!r} has no pair channel")


def _wait_for_address(key: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = internal_kv._internal_kv_get(key)
        if value is not None:
            return value.decode()
        time.sleep(0.01)
    raise TimeoutError(f"no rendezvous address under {key} after {timeout_s}s")

