"""Continuous batching: admit and prefill under a token and block budget, decode everything
running, preempt (recompute) when blocks run out. One step is either a prefill or a decode batch.

The scheduler owns the queues and the block pool; a request's blocks change only here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pegaserve.engine.block_pool import BlockPool
from pegaserve.engine.request import Request, Status


@dataclass(frozen=True)
class ScheduledBatch:
    """The requests of one step. Prefill computes each request's tokens from `num_computed_tokens`
    to `num_tokens`; decode computes the KV of each request's last token."""

    requests: tuple[Request, ...]
    is_prefill: bool


class Scheduler:
    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, enable_decode: bool) -> None:
        self.pool = pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_decode = enable_decode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or (self.enable_decode and bool(self.running))

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def add_running(self, request: Request, num_computed_tokens: int) -> bool:
        """Admit a request whose prompt KV arrives from elsewhere (decode role). False: no room."""
        num_blocks = self.pool.blocks_for(num_computed_tokens)
        if len(self.running) >= self.max_num_seqs or not self.pool.can_allocate(num_blocks):
            return False
        request.block_ids = self.pool.allocate(num_blocks)
        request.num_computed_tokens = num_computed_tokens
        request.set_status(Status.RUNNING)
        self.running.append(request)
        return True

    def schedule(self) -> ScheduledBatch | None:
        prefill = self._schedule_prefill()
        if prefill:
            return ScheduledBatch(tuple(prefill), is_prefill=True)
        if self.enable_decode and self.running:
            return ScheduledBatch(tuple(self._schedule_decode()), is_prefill=False)
        return None

    def _schedule_prefill(self) -> list[Request]:
        batch: list[Request] = []
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) + len(batch) < self.max_num_seqs:
            request = self.waiting[0]
            num_new_tokens = request.num_tokens - request.num_computed_tokens
            num_blocks = self.pool.blocks_for(request.num_tokens) - len(request.block_ids)
            if num_new_tokens > budget or not self.pool.can_allocate(num_blocks):
                break
            self.waiting.popleft()
            request.block_ids += self.pool.allocate(num_blocks)
            request.set_status(Status.RUNNING)
            budget -= num_new_tokens
            batch.append(request)
        self.running += batch
        return batch

    def _schedule_decode(self) -> list[Request]:
        """Every running request gets a slot for its last token, preempting from the back."""
        scheduled: list[Request] = []
        queue = list(self.running)
        while queue:
            request = queue.pop(0)
            num_blocks = self.pool.blocks_for(request.num_tokens) - len(request.block_ids)
            while not self.pool.can_allocate(num_blocks):
                victim = queue.pop() if queue else request
                self._preempt(victim)
                if victim is request:
                    break
            else:
                request.block_ids += self.pool.allocate(num_blocks)
                scheduled.append(request)
        return scheduled

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop the KV, keep the tokens, requeue at the front."""
        self.running.remove(request)
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0
        request.set_status(Status.WAITING)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def finish(self, request: Request) -> None:
        """Leave the queues and give the blocks back (finish, abort)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.pool.free(request.block_ids)
        request.block_ids = []
        request.set_status(Status.FINISHED)

    def park(self, request: Request) -> None:
        """Prefill role: keep the blocks for export, stop scheduling the request."""
        self.running.remove(request)
        request.set_status(Status.PARKED)
