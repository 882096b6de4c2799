"""KV pushed before decode asks, on pairs that carry pushes (`PairTransport.pushable`): with one
decode replica paired, a prefill replica sends a prompt's KV the moment it leases it, while the
first token travels through the ingress to decode; decode's fetch then finds the bytes landed, and
copies them into the blocks its engine reserved — instead of asking, waking prefill's thread and
waiting for the bytes.

A push is a header (`Pushed`: whose KV, its packed shape, how its blocks travel), then the blocks
straight from prefill's cache into a landing buffer and prefill's verdict on its read, as a
fetch's transfer (`PairChannel.send_with_verdict`) on tags apart from a fetch's (`TAGS`): both may
be under way on one pair. Pushes of a pair go one at a time (`Pusher`), so decode's `Inbox`
thread takes each header, then its blocks. A lease says where it was pushed (`Lease.pushed_to`);
a lease pushed elsewhere, or not at all, is fetched as before. Prefill counts the bytes a decode
replica has not claimed yet and pushes no more past `MAX_UNCLAIMED_BYTES`; decode keeps a push
until it is claimed, dropped (the request needed no transfer) or its lease's time is up.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import math
import pickle
import struct
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pegaserve.messages import ParkedKv
from pegaserve.pd.pair_channel import FETCH_TAG, NO_TIMEOUT, PairChannel, Staging, packed_shape, slab_runs

log = logging.getLogger("ray.serve")
HEADER_TAG = FETCH_TAG + 1
TAGS = 1 << 22  # a push's blocks and verdict: tags apart from a fetch's, which may be under way on the pair too
MAX_HEADER_BYTES = 64 << 10  # a header, ~100 bytes
MAX_UNCLAIMED_BYTES = 256 << 20  # per decode replica: pushed, not yet claimed (prefill's count)
FORGET_S = 60.0  # decode: a push never claimed is forgotten this long after its lease ran out
MAX_SPARE_BUFFERS = 4  # decode: landing buffers kept for the next pushes (a fresh one faults in its pages)
_LENGTH = struct.Struct("<q")


@dataclass(frozen=True)
class Pushed:
    request_id: str
    shape: tuple[int, ...]  # packed: [layers, 2, blocks, block_size, kv_heads, head_dim]
    dtype: str
    runs: list | None  # how the blocks travel (`PairChannel.send_blocks`): slabs of runs, or packed
    ttl_s: float  # how long the lease had left when it was pushed


class Pusher:
    """Prefill's side of one pair: its pushes, one at a time (in a thread of their own), and the
    bytes not claimed yet."""

    def __init__(self, pair: PairChannel, group_name: str) -> None:
        self.pair = pair
        self.group_name = group_name  # what a lease pushed on this pair names (`Lease.pushed_to`)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="pegaserve-kv-push")  # a push's messages go together
        self._staging = Staging()
        self._unclaimed: dict[str, tuple[int, float]] = {}  # request id -> bytes, until (monotonic)

    def room_for(self, num_bytes: int) -> bool:
        now = time.monotonic()
        self._unclaimed = {r: (n, until) for r, (n, until) in self._unclaimed.items() if until > now}
        return sum(n for n, _ in self._unclaimed.values()) + num_bytes <= MAX_UNCLAIMED_BYTES

    def reserve(self, request_id: str, num_bytes: int, until: float) -> None:
        self._unclaimed[request_id] = (num_bytes, until)

    def claimed(self, request_id: str) -> None:
        self._unclaimed.pop(request_id, None)

    def close(self, timeout_s: float) -> None:
        """After the pushes under way, the pair's last header, an empty one: decode's inbox thread
        ends, letting go of its side of the pair (its receive, always posted, would keep it open),
        and the pair closes. A pair already broken is let be."""

        def last_header() -> None:
            try:
                self.pair.post_send(torch.zeros(_LENGTH.size, dtype=torch.uint8), HEADER_TAG).wait(
                    datetime.timedelta(seconds=timeout_s))
            except Exception as exc:  # noqa: BLE001 - broken, or decode is gone: nothing is left to end
                log.debug("the last header of %s was not sent (%s)", self.group_name, exc)

        self.executor.submit(last_header)
        self.executor.shutdown(wait=False)

    def push(self, request_id: str, cache: torch.Tensor, parked: ParkedKv, generations: Sequence[int],
             delay_s: float = 0.0) -> bool:
        """Send the header, the lease's blocks straight from the cache (as a fetch's, into the
        landing buffer's positions 0..n-1) and, once they are read, whether they were the prompt's
        (after `delay_s`, a test's fault). Blocks (a worker thread); raises once the pair is broken.
        Returns the verdict."""
        if delay_s:
            time.sleep(delay_s)
        positions = range(len(parked.block_ids))
        runs = slab_runs(cache, parked.block_ids, positions)
        header = pickle.dumps(Pushed(request_id, packed_shape(cache, len(positions)), str(cache.dtype).removeprefix("torch."),
                                     runs, parked.held_until - time.monotonic()), protocol=pickle.HIGHEST_PROTOCOL)
        message = torch.frombuffer(bytearray(_LENGTH.pack(len(header)) + header), dtype=torch.uint8)
        self.pair.post_send(message, HEADER_TAG).wait()
        return self.pair.send_with_verdict(cache, parked.block_ids, positions, self._staging,
                                           lambda: parked.intact(parked.block_ids, generations, time.monotonic()),
                                           runs, TAGS)


class Inbox:
    """Decode's side of one pair: the pushes as they land (a thread of its own takes them), for
    `claim`. Lives on the replica's event loop; ends with the pair."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._landed: dict[str, tuple[torch.Tensor | None, float]] = {}  # id -> its KV (None: not held), until
        self._spare: list[torch.Tensor] = []
        self._waiting: dict[str, asyncio.Future] = {}
        self._ended: Exception | None = None

    def start(self, pair: PairChannel, name: str) -> None:
        threading.Thread(target=self._take, args=(pair,), name=f"pegaserve-kv-inbox-{name}", daemon=True).start()

    async def claim(self, request_id: str, timeout_s: float) -> torch.Tensor | None:
        """The KV pushed for `request_id`, packed, once it has landed; None if prefill's read of it
        did not hold. Raises if the pair ends first."""
        if request_id in self._landed:
            return self._landed.pop(request_id)[0]
        if self._ended is not None:
            raise ConnectionError(f"the pair ended before the push of {request_id} landed") from self._ended
        waiter = self._waiting.setdefault(request_id, self._loop.create_future())
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(waiter)
        finally:
            self._waiting.pop(request_id, None)
        return self._landed.pop(request_id)[0]

    def drop(self, request_id: str) -> None:
        self.recycle(self._landed.pop(request_id, (None,))[0])

    def recycle(self, data: torch.Tensor | None) -> None:
        """A landing buffer back, once its KV is copied out (or not wanted)."""
        if data is not None and len(self._spare) < MAX_SPARE_BUFFERS:
            self._spare.append(data if data._base is None else data._base)

    def _landing(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = math.prod(shape)
        for i, spare in enumerate(self._spare):
            if spare.dtype == dtype and spare.numel() >= numel:
                return self._spare.pop(i)[:numel].view(shape)
        return torch.empty(1 << max(numel - 1, 1).bit_length(), dtype=dtype)[:numel].view(shape)

    def _take(self, pair: PairChannel) -> None:
        header = torch.empty(MAX_HEADER_BYTES, dtype=torch.uint8)
        staging = Staging()
        try:
            while True:
                pair.post_recv(header, HEADER_TAG).wait(NO_TIMEOUT)  # raises once the pair is broken
                raw = header.numpy()
                (length,) = _LENGTH.unpack_from(raw)
                if length == 0:  # prefill closed the pair (`Pusher.close`)
                    raise ConnectionError("prefill closed the pair")
                pushed = pickle.loads(raw[_LENGTH.size : _LENGTH.size + length].tobytes())
                data = self._landing(pushed.shape, getattr(torch, pushed.dtype))
                positions = range(pushed.shape[2])
                if not pair.start_recv(data, positions, positions, staging, pushed.runs, TAGS)():
                    self.recycle(data)  # not the prompt's KV: its claim recomputes
                    data = None
                self._loop.call_soon_threadsafe(self._land, pushed, data)
        except Exception as exc:  # the pair ended: claims fail, and fetch or recompute instead
            try:
                self._loop.call_soon_threadsafe(self._end, exc)
            except RuntimeError:  # the loop is closed: the replica is stopping
                pass

    def _land(self, pushed: Pushed, data: torch.Tensor | None) -> None:
        now = time.monotonic()
        for request_id, (kept, until) in list(self._landed.items()):  # never claimed:
            if until + FORGET_S <= now:
                del self._landed[request_id]
            elif until <= now and kept is not None:  # its lease is over: a late claim recomputes
                self.recycle(kept)
                self._landed[request_id] = (None, until)
        self._landed[pushed.request_id] = (data, now + pushed.ttl_s)
        waiter = self._waiting.get(pushed.request_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _end(self, exc: Exception) -> None:
        self._ended = exc
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(ConnectionError("the pair ended before the push landed"))
