"""`object_store`: prefill packs the prompt into Ray's object store as it leases it and frees its
blocks at once; the lease carries the reference, and decode gets it and unpacks it into the blocks
its engine reserved. The simple baseline: it runs anywhere Ray does."""

from __future__ import annotations

import asyncio
import time
import warnings

import numpy as np
import ray
import torch

from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.messages import ParkedKv, ReceiveTarget
from pegaserve.pd.protocol import Lease
from pegaserve.pd.transports.base import KvTransport, LeaseKv, Receiving, to_the_end
from pegaserve.runner.model_runner import pack_blocks, unpack_blocks


class ObjectStoreTransport(KvTransport):
    name = "object_store"
    frees_at_lease = True  # the KV left the prefill engine at lease time

    async def lease_kv(self, engine: AsyncEngine, request_id: str, parked: ParkedKv) -> LeaseKv:
        packed = await asyncio.to_thread(pack_blocks, engine.kv_cache, parked.block_ids)
        kv_ref = None
        if parked.intact(parked.block_ids, engine.kv_generations, time.monotonic()):
            kv_ref = [ray.put(kv_as_bytes(packed))]
        engine.release(request_id)
        return LeaseKv(kv_ref=kv_ref)

    async def receive(self, receiver: Receiving, lease: Lease, target: ReceiveTarget,
                      choice_ids: tuple[str, ...]) -> int | None:
        if lease.kv_ref is None:
            return None  # the lease expired before prefill could put the KV in the store
        data = await lease.kv_ref[0]
        packed = kv_from_bytes(data, lease.kv_dtype, lease.kv_shape)[:, :, target.first_block :]
        await to_the_end(asyncio.to_thread(unpack_blocks, receiver.kv_cache, target.block_ids, packed))
        return packed.numel() * packed.element_size()


def kv_as_bytes(kv: torch.Tensor) -> np.ndarray:
    """The object store's form of packed KV: raw bytes in a numpy array, which Ray stores without
    pickling and maps zero-copy on get (a pickled torch tensor costs ~4x more; bf16 has no numpy dtype)."""
    return kv.detach().contiguous().cpu().view(torch.uint8).numpy()


def kv_from_bytes(data: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():  # the mapped array is read-only; the engine only copies from it
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(data)
    return raw.view(getattr(torch, dtype)).reshape(shape)
