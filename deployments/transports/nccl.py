"""`nccl`: the KV on a pair channel of `ray.util.collective` with backend nccl (cupy), one 2-rank
group per prefill/decode pair, between GPU replicas. Its sends and receives block and match in
order (no tags), so the fetch travels on the replicas' connection and each side finds the runs itself.
"""

from __future__ import annotations

import asyncio

import torch

from pegaserve.net.channel import Connection
from pegaserve.pd.pair_channel import Done, PairChannel, Work
from pegaserve.pd.protocol import PairOffer
from pegaserve.pd.transports.base import PairTransport


class NcclTransport(PairTransport):
    name = "nccl"
    summary = "GPUs"

    @classmethod
    def check(cls, device: str) -> None:
        if device != "cuda":
            raise ValueError("transport nccl needs engine.device: cuda (use gloo or object_store on CPU)")
        try:
            import cupy  # noqa: F401, PLC0415 - only to prove the GPU extra is installed
        except ImportError as exc:
            raise ValueError("transport nccl needs cupy: pip install 'pegaserve[gpu]'") from exc

    async def offer_pair(self, connection: Connection, group_name: str, timeout_s: float) -> PairChannel:
        connection.send(PairOffer("", 0))  # the group's rendezvous is Ray's (its named actor)
        return await asyncio.to_thread(NcclPair, group_name, 0)

    async def join_pair(self, offer: PairOffer, group_name: str, timeout_s: float) -> PairChannel:
        return await asyncio.to_thread(NcclPair, group_name, 1)


class NcclPair(PairChannel):
    def __init__(self, group_name: str, rank: int) -> None:
        from ray.util import collective  # noqa: PLC0415 - needs cupy, a GPU extra

        self._collective = collective
        self._name = group_name
        self._peer = 1 - rank
        collective.init_collective_group(2, rank, backend="nccl", group_name=group_name)

    def post_send(self, tensor: torch.Tensor, tag: int) -> Work:
        self._collective.send(tensor, self._peer, self._name)  # in order, so the tag is not needed
        return Done()

    def post_recv(self, tensor: torch.Tensor, tag: int) -> Work:
        self._collective.recv(tensor, self._peer, self._name)
        return Done()
