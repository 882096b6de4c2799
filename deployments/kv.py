"""The KV handoff's control plane: leases on prefill, fetches from decode, one port per prefill.

Serve routes calls to *some* replica; a KV fetch must reach the one prefill replica holding the
blocks. Each prefill replica therefore owns a small named actor, its `KvPort`, that decode (fetch)
and the ingress (release) address by name. The prefill replica drains its port in order.

Lease: prefill keeps a non-terminal request's blocks until they are sent (nccl/gloo: the matching
recv is the acknowledgement; object store: once the packed copy is in the store) or released, or
until `lease_timeout_s` passes. A fetch that finds no lease gets `ok=False`, and decode recomputes.
"""

from __future__ import annotations

import asyncio
import uuid
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import ray
import torch


PORT_NAMESPACE = "pegaserve"


@dataclass(frozen=True)
class Lease:
    """What the ingress hands decode so it can claim the prompt's blocks from prefill."""

    request_id: str
    prefill_replica: str
    port_name: str
    kv_shape: tuple[int, ...]
    kv_dtype: str


@dataclass(frozen=True)
class Fetch:
    request_id: str
    decode_replica: str
    group_name: str  # nccl/gloo: the pair channel to send on


@dataclass(frozen=True)
class Release:
    request_id: str


@dataclass(frozen=True)
class FetchReply:
    ok: bool
    reason: str = ""
    kv_bytes: int = 0
    kv_ref: list | None = None  # object store: [ObjectRef] (wrapped so Ray does not resolve it)


def port_name(prefill_replica: str) -> str:
    return f"pegaserve-kv-port-{prefill_replica}"


def kv_as_bytes(kv: torch.Tensor) -> np.ndarray:
    """The object store's form of packed KV: raw bytes in a numpy array, which Ray stores without
    pickling and maps zero-copy on get (a pickled torch tensor costs ~4x more; bf16 has no numpy dtype)."""
    return kv.detach().contiguous().cpu().view(torch.uint8).numpy()


def kv_from_bytes(data: np.ndarray, lease: Lease) -> torch.Tensor:
    with warnings.catch_warnings():  # the mapped array is read-only; the engine only copies from it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(data)
    return raw.view(getattr(torch, lease.kv_dtype)).reshape(lease.kv_shape)


class PortDirectory:
    """Handles of prefill replicas' ports, looked up once each (a lookup is a blocking GCS call)."""

    def __init__(self, max_entries: int = 1024) -> None:
        self._handles: OrderedDict[str, ray.actor.ActorHandle] = OrderedDict()
        self._max_entries = max_entries

    async def get(self, name: str):
        handle = self._handles.get(name)
        if handle is None:
            handle = await asyncio.to_thread(ray.get_actor, name, namespace=PORT_NAMESPACE)
            self._handles[name] = handle
            if len(self._handles) > self._max_entries:
                self._handles.popitem(last=False)  # replicas come and go; old names never return
        return handle


@ray.remote(num_cpus=0)
class KvPort:
    """A mailbox with replies. `call` returns what the prefill replica `reply`s; calls from one
    caller reach `next` in the order they were made."""

    def __init__(self) -> None:
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._waiting: dict[str, asyncio.Future] = {}

    async def call(self, message: Fetch | Release) -> FetchReply | None:
        key = uuid.uuid4().hex
        future = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        await self._inbox.put((key, message))
        return await future

    async def next(self) -> tuple[str, Fetch | Release]:
        return await self._inbox.get()

    async def reply(self, key: str, result: FetchReply | None) -> None:
        future = self._waiting.pop(key, None)
        if future is not None and not future.done():
            future.set_result(result)
