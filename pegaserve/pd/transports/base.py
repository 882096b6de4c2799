"""What a KV transport is: one class per way a prompt's KV moves from a prefill replica to a decode
replica, chosen by name from the registry (registry.py), as vLLM's KV connectors are. Each has a
sender half, which the prefill replica's `KvSender` runs as it makes a lease (`lease_kv`: what
the lease carries), and a receiver half, which the decode replica's `KvReceiver` runs to write the
prompt's blocks into the blocks its engine reserved (`route`, `receive`).

A transport that moves the bytes over a pair channel between the two replicas is a
`PairTransport`: it only opens the pairs (`offer_pair` at prefill, `join_pair` at decode); the
sender and the receiver run the fetches on them, in an order both sides agree on (pd/pair_channel.py).

One instance per replica side, made with the replica's node (`NodeInfo`): where its listeners
listen, and which peers share its machine. The instance may keep that side's state (mapped files).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import ClassVar, Protocol, TypeVar

import torch

from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.messages import ParkedKv, ReceiveTarget
from pegaserve.net.channel import Connection
from pegaserve.net.node import NodeInfo
from pegaserve.pd.pair_channel import PairChannel
from pegaserve.pd.protocol import Lease, PairOffer, SharedCache

T = TypeVar("T")


@dataclass(frozen=True)
class LeaseKv:
    """What a transport's sender half puts in a lease besides where the blocks lie."""

    kv_ref: list | None = None  # a reference to the packed prompt, in a store decode reads from
    shared: SharedCache | None = None  # where decode replicas of this node map the prefill engine's cache


class Receiving(Protocol):
    """What a transport's receiver half sees of the decode replica's `KvReceiver`."""

    @property
    def kv_cache(self) -> torch.Tensor:
        """The decode engine's KV cache, where the blocks go."""

    async def copied(self, lease: Lease, choice_ids: tuple[str, ...], kv_bytes: int, seconds: float,
                     held: bool) -> None:
        """Tell the prefill replica that decode is done with the lease's blocks (it frees them)."""

    async def pull(self, pairs: PairTransport, lease: Lease, target: ReceiveTarget,
                   choice_ids: tuple[str, ...]) -> int | None:
        """Fetch the blocks on the pair channel to the lease's prefill replica (opened on `pairs`)."""


class KvTransport(ABC):
    """A way the KV moves, both halves. Subclasses set `name` (what a config and the registry call
    it, and what its transfers are recorded as in the ledger and the metrics)."""

    name: ClassVar[str]
    summary: ClassVar[str] = ""  # a few words for the config's description of the choices
    pushes: ClassVar[bool] = False  # prefill pushes a lease's KV on the pair as it makes it (`push_kv`)
    frees_at_lease: ClassVar[bool] = False  # `lease_kv` freed the blocks: prefill need not hear of them

    def __init__(self, node: NodeInfo) -> None:
        self.node = node

    @classmethod
    def check(cls, device: str) -> None:
        """Raise ValueError, naming what is missing, where this transport cannot run between engines
        on `device` ("cpu" or "cuda")."""

    @property
    def names(self) -> tuple[str, ...]:
        """The names its transfers are recorded under: its own, and that of the transport it falls back on."""
        return (self.name,)

    @property
    def pairs(self) -> PairTransport | None:
        """The pair channels its fetches run on, if it has any."""
        return None

    def warm_up(self) -> None:
        """Start, in the background, what its first transfer would otherwise wait for (a replica's start)."""

    # --- the sender's half (prefill) -------------------------------------------------------------

    async def lease_kv(self, engine: AsyncEngine, request_id: str, parked: ParkedKv) -> LeaseKv:
        """As prefill leases a parked request's blocks: what the lease carries for decode."""
        return LeaseKv()

    # --- the receiver's half (decode) ------------------------------------------------------------

    def route(self, lease: Lease) -> KvTransport:
        """The transport that moves this lease's bytes: this one, or the one it falls back on."""
        return self

    def copies_in_engine(self, lease: Lease) -> bool:
        """Whether decode's engine should copy the lease's KV itself as it admits the request."""
        return False

    @abstractmethod
    async def receive(self, receiver: Receiving, lease: Lease, target: ReceiveTarget,
                      choice_ids: tuple[str, ...]) -> int | None:
        """Write the lease's blocks after `target.first_block` into `target.block_ids` of the
        receiver's cache; the bytes written, or None when the lease no longer held them (decode
        recomputes). Raises when the transfer failed. Returns only once nothing writes into
        `target` any more (`to_the_end`)."""


class PairTransport(KvTransport):
    """The bytes travel on a pair channel between the two replicas, one per prefill/decode pair,
    opened on their connection at decode's first fetch (`OpenPair`)."""

    pushable: ClassVar[bool] = False  # its pairs carry pushes (pd/push.py: a Pusher at prefill, an Inbox at decode)

    @property
    def pairs(self) -> PairTransport:
        return self

    @abstractmethod
    async def offer_pair(self, connection: Connection, group_name: str, timeout_s: float) -> PairChannel:
        """Prefill: answer decode's `OpenPair` on `connection` with a `PairOffer`, and open prefill's side (rank 0)."""

    @abstractmethod
    async def join_pair(self, offer: PairOffer, group_name: str, timeout_s: float) -> PairChannel:
        """Decode: open its side of the pair (rank 1) that prefill offered."""

    async def receive(self, receiver: Receiving, lease: Lease, target: ReceiveTarget,
                      choice_ids: tuple[str, ...]) -> int | None:
        return await receiver.pull(self, lease, target, choice_ids)


def source_blocks(lease: Lease, target: ReceiveTarget) -> tuple[int, ...]:
    """The lease's blocks that go into `target` (those after the prefix decode has cached)."""
    source = lease.parked.block_ids[target.first_block :]
    if len(source) != len(target.block_ids):
        raise ValueError(f"{len(source)} blocks leased, {len(target.block_ids)} to fill")
    return source


async def to_the_end(copy: Awaitable[T]) -> T:
    """The result of `copy` — into this replica's cache — awaited to its end even when cancelled
    meanwhile: its thread writes into blocks the engine reserved, so it must never outlive the fetch."""
    task = asyncio.ensure_future(copy)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise
