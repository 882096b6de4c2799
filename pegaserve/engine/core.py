"""The engine: `step()` schedules, runs the model, and hands the sampled tokens back to the
scheduler, which classifies them and returns each choice's output.

One engine class serves three roles. `both` (colocated) prefills and decodes; `prefill` samples
and classifies the first token, then parks the request's blocks for export (or finishes it there
when that token is terminal, docs/contract.md rule 21); `decode` takes a prompt's blocks with the
first token (rule 22) and continues after it — or recomputes the prompt when no KV came.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from pegaserve.config import EngineConfig, Role
from pegaserve.kv.block_pool import BlockPool
from pegaserve.kv.manager import KvCacheManager
from pegaserve.messages import (
    EngineOverloaded,
    EngineRequest,
    EngineStats,
    Handoff,
    ParkedKv,
    ReceiveTarget,
    RequestRejected,
    SharedReceipt,
    StepOutput,
)
from pegaserve.request import RequestState
from pegaserve.runner.model_runner import ModelRunner, copy_blocks
from pegaserve.sample.grammar import Grammars
from pegaserve.sched.scheduler import Scheduler
from pegaserve.sched.speculation import make_proposer

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, model, config: EngineConfig = EngineConfig(), device: str = "cpu") -> None:
        self.config = config
        self.model_config = model.config
        self.max_model_len = model.config.context_len(config.max_model_len)
        self.pool = BlockPool(config.num_blocks, config.block_size)
        self.kv = KvCacheManager(self.pool, config.enable_prefix_caching)
        proposer = make_proposer(config.speculative) if config.role is not Role.PREFILL else None
        self.grammars = Grammars(model.config)
        self.scheduler = Scheduler(config, self.kv, self.max_model_len, proposer, self.grammars)
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, device)

    # --- admission -------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> None:
        if self.config.role is Role.DECODE:
            raise RequestRejected("a decode engine takes handoffs (add_handoff), not fresh requests")
        self._check(request, range(request.n))
        self.scheduler.add(request)

    def add_handoff(self, handoff: Handoff) -> bool:
        """Continue a prefilled request whose packed KV is in hand (or None). Returns False when it
        has to recompute the prompt (no KV, or no room to import it now); the tokens are the same
        either way."""
        target = self.receive(handoff)
        if target is None:
            return False
        if handoff.kv is None:
            self.received(handoff.request.request_id, ok=False)
            return False
        self.runner.import_blocks(target.block_ids, handoff.kv[:, :, target.first_block :])
        self.received(handoff.request.request_id, ok=True)
        return True

    def add_shared_handoff(self, handoff: Handoff, source: torch.Tensor | None, generations: Sequence[int],
                           parked: ParkedKv) -> SharedReceipt | None:
        """Continue a prefilled request whose KV lies in another engine's cache on this node
        (`source`, mapped, or None when it could not be), copied here now: the request runs in the
        next step, where `receive` + `received` around a copy by the caller take two step
        boundaries. None: no room, the request recomputes its prompt (nothing was read)."""
        target = self.receive(handoff)
        if target is None:
            return None
        start = time.perf_counter()
        cache = self.runner.kv_cache
        source_ids = list(parked.block_ids[target.first_block :])
        held = (source is not None and _same_layout(source, cache) and len(source_ids) == len(target.block_ids))
        if held and source_ids:
            try:
                copy_blocks(source, source_ids, cache, list(target.block_ids))
            except (RuntimeError, IndexError) as exc:  # a lease naming blocks its cache lacks: recompute
                log.warning("copying the KV of %s failed (%s)", handoff.request.request_id, exc)
                held = False
            else:
                held = parked.intact(source_ids, generations, time.monotonic())  # one node: one clock
        self.received(handoff.request.request_id, ok=held)  # never left receiving: the blocks are freed or used
        return SharedReceipt(len(source_ids), held, time.perf_counter() - start)

    def receive(self, handoff: Handoff) -> ReceiveTarget | None:
        """Decode role, KV still to come: blocks for the prompt after its cached prefix (the caller
        fills them, then calls `received`). None: no room, the request recomputes its prompt."""
        if self.config.role is Role.PREFILL:
            raise RequestRejected("a prefill engine does not take handoffs")
        self._check(handoff.request, [index for index, _ in handoff.choices])
        return self.scheduler.receive(handoff)

    def received(self, request_id: str, ok: bool) -> None:
        """The KV of `receive`'s blocks is written (ok), or it will never come (recompute)."""
        self.scheduler.received(request_id, ok)

    def _check(self, request: EngineRequest, indices) -> None:
        if len(self.scheduler.waiting) >= self.config.max_queued_requests:
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} requests already wait for this engine")
        if request.request_id in self.scheduler.groups or any(
                request.choice_id(i) in self.scheduler.requests for i in indices):
            raise RequestRejected(f"request id {request.request_id!r} is already in this engine")
        if not request.prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        num_tokens = len(request.prompt_token_ids) + request.policy.max_tokens
        if num_tokens > self.max_model_len:
            raise RequestRejected(f"prompt + max_tokens = {num_tokens} exceeds max_model_len {self.max_model_len}")
        if self.pool.blocks_for(num_tokens) > self.pool.num_blocks:
            raise RequestRejected(f"prompt + max_tokens = {num_tokens} tokens exceeds the KV cache")

    # --- the loop --------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        output = self.scheduler.schedule()
        if output is None:
            return []
        return self.scheduler.update(output, self.runner.run(output))

    def fail_running(self, message: str) -> list[StepOutput]:
        """After a step raised: abort the requests it ran (any running one may be half-updated)
        and report each as failed; waiting, parked and receiving requests are untouched."""
        return self.scheduler.fail_running(message)

    # --- prefill role: export --------------------------------------------------------------------

    @property
    def parked(self) -> dict[str, RequestState]:
        return self.scheduler.leases.parked

    def parked_block_ids(self, request_id: str) -> tuple[int, ...]:
        """The prompt's blocks of a parked request (its choices share them)."""
        choices = self.scheduler.parked_choices(request_id)
        if not choices:
            raise KeyError(f"no parked request {request_id!r}")
        return self.kv.block_ids(choices[0].request_id)

    def export_shape(self, request_id: str, first_block: int = 0) -> tuple[int, ...]:
        """The shape `export_kv` will have, without copying anything."""
        shape = list(self.runner.kv_cache.shape)
        shape[2] = len(self.parked_block_ids(request_id)) - first_block
        return tuple(shape)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.runner.kv_cache.dtype

    def export_kv(self, request_id: str, first_block: int = 0) -> torch.Tensor:
        """The prompt's KV from `first_block` on, packed:
        `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`."""
        return self.runner.export_blocks(self.parked_block_ids(request_id)[first_block:])

    def release(self, request_id: str) -> bool:
        """Free a parked request's blocks (decode acknowledged, or the lease expired)."""
        return self.scheduler.release(request_id)

    def expire_leases(self) -> list[str]:
        return self.scheduler.expire_leases(time.monotonic())

    # --- cancellation and stats -------------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        """Abort a request (all its choices) or one choice, wherever it is."""
        return self.scheduler.abort(request_id)

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.scheduler.requests

    def stats(self) -> EngineStats:
        s, spec, cache = self.scheduler, self.scheduler.drafter.stats, self.kv.stats
        return EngineStats(
            num_waiting=len(s.waiting),
            num_running=len(s.running),
            num_parked=len(s.leases.parked),
            num_receiving=sum(len(c) for c in s.receiving.values()),
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_cached_blocks=self.pool.num_cached_blocks,
            num_preemptions=s.num_preemptions,
            prefix_cache_queried_tokens=cache.num_queried_tokens,
            prefix_cache_hit_tokens=cache.num_hit_tokens,
            num_draft_tokens=spec.num_draft_tokens,
            num_accepted_tokens=spec.num_accepted_tokens,
            num_spec_steps=spec.num_steps,
            num_spec_emitted_tokens=spec.num_emitted_tokens,
        )


def _same_layout(source: torch.Tensor, cache: torch.Tensor) -> bool:
    """Blocks of `source` can be copied into `cache` byte for byte (the number of blocks aside)."""
    return source.dtype == cache.dtype and (*source.shape[:2], *source.shape[3:]) == (*cache.shape[:2], *cache.shape[3:])
