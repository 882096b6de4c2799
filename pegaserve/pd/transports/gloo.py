"""`gloo`: the KV on a pair channel of torch.distributed's `ProcessGroupGloo` (CPU), one 2-rank
group per prefill/decode pair, its rendezvous a TCPStore that prefill opens on its node's address
and names in a `PairOffer` (Ray's gloo collective group would make each process join a single
default torch.distributed world, which would tie a replica to one peer for life).

The fetch itself travels on the pair (`carries_fetches`) and both ends run in C++ where it built
(`native`, csrc/gloo_pair.cpp): no Python between a fetch and its bytes. Gloo posts a receive at
once and lands the bytes from its own threads (`posts_at_once`), and its pairs carry pushes: a
prefill replica paired with one decode replica sends each lease's KV before decode asks (pd/push.py).
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Callable, Sequence

import torch

from pegaserve.net.channel import Connection
from pegaserve.pd import pair_channel
from pegaserve.pd.pair_channel import (
    FETCH_TAG,
    FIND,
    VERDICT_TAG,
    WORD_BYTES,
    PairChannel,
    Runs,
    Served,
    Staging,
    Work,
    fetch_message,
    read_fetch,
    slab_runs,
)
from pegaserve.pd.protocol import Fetch, PairOffer
from pegaserve.pd.transports import native
from pegaserve.pd.transports.base import PairTransport

LOOPBACK = "127.0.0.1"


class GlooTransport(PairTransport):
    name = "gloo"
    pushes = True
    pushable = True

    def warm_up(self) -> None:
        native.warm_up()

    async def offer_pair(self, connection: Connection, group_name: str, timeout_s: float) -> PairChannel:
        store = await asyncio.to_thread(GlooPair.offer, timeout_s, self.node.ip)
        connection.send(PairOffer(self.node.ip, store.port))
        return await asyncio.wait_for(asyncio.to_thread(GlooPair, store, 0, timeout_s), timeout_s)

    async def join_pair(self, offer: PairOffer, group_name: str, timeout_s: float) -> PairChannel:
        store = await asyncio.to_thread(GlooPair.join, offer.host, offer.port, timeout_s)
        return await asyncio.to_thread(GlooPair, store, 1, timeout_s)


class GlooPair(PairChannel):
    """`pull` and `serve_fetch` run in C++ (`native`) where it built: from a fetch to its bytes and
    verdict, no Python on either side. Both sides speak the same messages either way."""

    posts_at_once = True
    carries_fetches = True  # a receive shorter than its buffer is fine on gloo; the peer's end ends a wait

    def __init__(self, store: torch.distributed.TCPStore, rank: int, timeout_s: float, use_native: bool = True) -> None:
        self._store = store  # the group keeps using it
        self._peer = 1 - rank
        self._group = torch.distributed.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=timeout_s))
        self._native = native.module() if use_native else None
        self._generations: tuple[object, torch.Tensor | None] = (None, None)

    def pull(self, cache: torch.Tensor, fetch: Fetch, staging: Staging, runs: Runs = FIND) -> Callable[[], bool]:
        if runs is FIND:
            runs = slab_runs(cache, fetch.source_block_ids, fetch.target_block_ids,
                             pair_channel.NATIVE_MIN_SLAB_BYTES if self._native is not None else None)
        if self._native is None or runs is None:
            return super().pull(cache, fetch, staging, runs)
        return self._native.pull(self._group, cache, fetch_message(fetch, runs), staging.flag(cache.device),
                                 self._peer, VERDICT_TAG, FETCH_TAG).wait

    def serve_fetch(self, cache: torch.Tensor, generations: Sequence[int], buffer: torch.Tensor, staging: Staging,
                    delay_s: float = 0.0) -> Served:
        live = self._int64s(generations)
        if self._native is None or live is None:
            return super().serve_fetch(cache, generations, buffer, staging, delay_s)
        buffer[:WORD_BYTES].zero_()
        done = self._native.serve_fetch(self._group, cache, live, buffer, staging.flag(cache.device), self._peer,
                                        VERDICT_TAG, FETCH_TAG, delay_s)
        fetch, runs = read_fetch(buffer)
        if done.sent:
            return Served(fetch, done.held, done.seconds)
        return self.send_fetched(cache, generations, fetch, staging, delay_s, runs)  # packed: C++ sends only slabs

    def _int64s(self, generations: Sequence[int]) -> torch.Tensor | None:
        """The live generations as an int64 tensor over the same memory (an array or a memoryview
        of int64, as the engine keeps them), or None (the Python side checks them)."""
        source, view = self._generations
        if source is not generations:
            try:
                view = torch.frombuffer(generations, dtype=torch.int64)
            except (TypeError, ValueError):
                view = None
            self._generations = (generations, view)
        return view

    @staticmethod
    def offer(timeout_s: float, host: str = LOOPBACK) -> torch.distributed.TCPStore:
        """Prefill: the rendezvous (its port goes in a PairOffer). It listens on every interface;
        `host` is where its own side reaches it: this node's address."""
        return torch.distributed.TCPStore(host, 0, 2, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                                          wait_for_workers=False)

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
