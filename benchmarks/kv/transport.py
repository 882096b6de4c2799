"""Raw send/recv bandwidth of each CPU KV transport between two plain Ray actors.

The yardstick for the handoff figures in `benchmarks.kv.run`: the same number of bytes, moved the way the
transport moves them, without Serve, leases, the KV port or the engine around it.
- gloo: `pegaserve.pd.transports.gloo.GlooPair` (torch.distributed ProcessGroupGloo over TCP, 127.0.0.1),
  one tensor send on rank 0, the matching recv on rank 1, timed on the receiver, two ways: `one-way`, the
  sender sending back to back (the bandwidth: the receiver's clock starts with the bytes already on their way),
  and `request`, the least any fetch can do: the receiver posts its receive and sends a 4-byte request, the
  sender waits for it and sends (a round trip more, and both sides wake from a wait, as in a handoff); and
  `idle`, the same on request after `IDLE_S` of both sides idle (the sender blocked in its wait, the receiver
  asleep), as between two handoffs of the benchmark, which sends one prompt at a time: what waking up from a
  quiet machine costs the bare transport.
- object_store: `ray.put` in one actor, `ray.get` in the other; put and get are timed each and
  reported as their sum (the handoff does both on its critical path). Measured for a torch tensor
  (what the app ships) and, for comparison, for the same bytes as a numpy array (which Ray stores
  without pickling and `ray.get` maps zero-copy).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import ray
import torch

ACTOR_OPTIONS = {"num_cpus": 0.1}
TIMEOUT_S = 60.0
REQUEST_TAG = 1
IDLE_S = 0.2  # the `idle` pattern's quiet spell before each transfer: about a 2048-token prompt's prefill
PATTERNS = ("one-way", "request", "idle")


@dataclass(frozen=True)
class RawFigure:
    transport: str
    num_bytes: int
    median_s: float
    runs_s: tuple[float, ...]
    payload: str = "torch"  # object_store only: "torch" (as the app) or "numpy"
    median_put_s: float | None = None
    median_get_s: float | None = None
    pattern: str = "one-way"  # gloo only: one of PATTERNS

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.median_s / 1e9


@ray.remote
class GlooEnd:
    def offer(self) -> tuple[str, int]:
        """Rank 0: open the pair's rendezvous, as prefill does; where rank 1 joins it."""
        from pegaserve.pd.transports.gloo import GlooPair  # noqa: PLC0415

        self.store = GlooPair.offer(TIMEOUT_S)
        return ray.util.get_node_ip_address(), self.store.port

    def open(self, rank: int, host: str | None = None, port: int | None = None) -> None:
        from pegaserve.pd.transports.gloo import GlooPair  # noqa: PLC0415

        store = self.store if rank == 0 else GlooPair.join(host, port, TIMEOUT_S)
        self.pair = GlooPair(store, rank, TIMEOUT_S)

    def send(self, num_bytes: int, repeats: int, on_request: bool) -> None:
        tensor = torch.ones(num_bytes // 4, dtype=torch.float32)
        request = torch.zeros(1, dtype=torch.int32)
        for _ in range(repeats):
            if on_request:
                self.pair.post_recv(request, REQUEST_TAG).wait()
            self.pair.send(tensor)

    def recv(self, num_bytes: int, repeats: int, on_request: bool, idle_s: float = 0.0) -> list[float]:
        tensor = torch.empty(num_bytes // 4, dtype=torch.float32)
        request = torch.zeros(1, dtype=torch.int32)
        runs = []
        for _ in range(repeats):
            time.sleep(idle_s)
            start = time.perf_counter()
            if on_request:
                received = self.pair.post_recv(tensor, 0)
                self.pair.post_send(request, REQUEST_TAG).wait()
                received.wait()
            else:
                self.pair.recv(tensor)
            runs.append(time.perf_counter() - start)
        return runs


@ray.remote
class StoreEnd:
    def put(self, num_bytes: int, payload: str) -> tuple[list, float]:
        tensor = torch.ones(num_bytes // 4, dtype=torch.float32)
        if payload == "numpy":
            tensor = tensor.numpy()
        start = time.perf_counter()
        ref = ray.put(tensor)
        return [ref], time.perf_counter() - start  # wrapped, so Ray hands over the ref unresolved

    def get(self, refs: list) -> float:
        start = time.perf_counter()
        value = ray.get(refs[0])
        seconds = time.perf_counter() - start
        assert len(value) > 0
        return seconds


def gloo_bandwidth(sizes: list[int], repeats: int, warmup: int = 2) -> list[RawFigure]:
    sender, receiver = GlooEnd.options(**ACTOR_OPTIONS).remote(), GlooEnd.options(**ACTOR_OPTIONS).remote()
    host, port = ray.get(sender.offer.remote(), timeout=TIMEOUT_S)
    ray.get([sender.open.remote(0), receiver.open.remote(1, host, port)], timeout=TIMEOUT_S)
    figures = []
    try:
        for pattern in PATTERNS:
            for num_bytes in sizes:
                total, on_request = warmup + repeats, pattern != "one-way"
                sent = sender.send.remote(num_bytes, total, on_request)
                received = receiver.recv.remote(num_bytes, total, on_request, IDLE_S if pattern == "idle" else 0.0)
                runs = ray.get(received, timeout=TIMEOUT_S)[warmup:]
                ray.get(sent, timeout=TIMEOUT_S)
                figures.append(RawFigure("gloo", num_bytes, statistics.median(runs), tuple(runs), pattern=pattern))
    finally:
        ray.kill(sender)
        ray.kill(receiver)
    return figures


def object_store_bandwidth(sizes: list[int], repeats: int, warmup: int = 2) -> list[RawFigure]:
    producer, consumer = StoreEnd.options(**ACTOR_OPTIONS).remote(), StoreEnd.options(**ACTOR_OPTIONS).remote()
    figures = []
    try:
        for payload in ("torch", "numpy"):
            for num_bytes in sizes:
                puts, gets = [], []
                for i in range(warmup + repeats):
                    refs, put_s = ray.get(producer.put.remote(num_bytes, payload), timeout=TIMEOUT_S)
                    get_s = ray.get(consumer.get.remote(refs), timeout=TIMEOUT_S)
                    del refs
                    if i >= warmup:
                        puts.append(put_s)
                        gets.append(get_s)
                runs = tuple(p + g for p, g in zip(puts, gets))
                figures.append(RawFigure("object_store", num_bytes, statistics.median(runs), runs, payload,
                                         statistics.median(puts), statistics.median(gets)))
    finally:
        ray.kill(producer)
        ray.kill(consumer)
    return figures


def raw_bandwidth(transport: str, sizes: list[int], repeats: int = 20) -> list[RawFigure]:
    if transport == "gloo":
        return gloo_bandwidth(sizes, repeats)
    if transport == "object_store":
        return object_store_bandwidth(sizes, repeats)
    raise ValueError(f"no raw measurement for transport {transport!r}")
