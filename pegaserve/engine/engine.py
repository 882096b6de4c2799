"""The engine: `step()` schedules, runs the model, classifies the new tokens and returns them.

One engine class serves three roles. `both` (colocated) prefills and decodes; `prefill` samples
and classifies the first token, then parks the request's blocks for export (or finishes it there
when that token is terminal, docs/CONTRACT.md rule 21); `decode` imports a prompt's blocks with the
first token (rule 22) and continues after it — or recomputes the prompt when no KV came.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from pegaserve.engine.block_pool import BlockPool
from pegaserve.engine.request import EngineRequest, Handoff, Request, StepOutput, Status
from pegaserve.engine.runner import ModelRunner
from pegaserve.engine.scheduler import Scheduler
from pegaserve.stop import Abort, StopCause


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


@dataclass(frozen=True)
class EngineConfig:
    role: Role = Role.BOTH
    block_size: int = 16
    num_blocks: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_queued_requests: int = 1024  # waiting requests past this are refused (EngineOverloaded)


class RequestRejected(ValueError):
    """The request can never run on this engine (it names the limit it breaks)."""


class EngineOverloaded(RuntimeError):
    """The engine's waiting queue is full: the request may succeed later (HTTP 429)."""


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_parked: int
    num_blocks: int
    num_free_blocks: int
    num_preemptions: int


class Engine:
    def __init__(self, model, config: EngineConfig = EngineConfig(), device: str = "cpu") -> None:
        self.config = config
        self.model_config = model.config
        self.max_model_len = min(config.max_model_len or 10**9, model.config.max_position_embeddings)
        if config.max_num_batched_tokens < self.max_model_len:
            raise ValueError("max_num_batched_tokens must be >= max_model_len: a prompt is prefilled in one step")
        self.pool = BlockPool(config.num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.pool, config.max_num_seqs, config.max_num_batched_tokens, enable_decode=config.role != Role.PREFILL
        )
        self.runner = ModelRunner(model, config.num_blocks, config.block_size, device)
        self.requests: dict[str, Request] = {}
        self.parked: dict[str, Request] = {}

    # --- admission -------------------------------------------------------------------------------

    def add_request(self, spec: EngineRequest) -> None:
        if self.config.role == Role.DECODE:
            raise RequestRejected("a decode engine takes handoffs (add_handoff), not fresh requests")
        self.scheduler.add(self._admit(spec))

    def add_handoff(self, handoff: Handoff) -> bool:
        """Continue a prefilled request. Returns False when it has to recompute the prompt (no KV,
        or no room to import it now); the tokens are the same either way."""
        if self.config.role == Role.PREFILL:
            raise RequestRejected("a prefill engine does not take handoffs")
        request = self._admit(handoff.request)
        cause = request.append(handoff.first_token, self.max_model_len)
        assert cause is None, "a terminal first token never leaves prefill (rule 21)"
        num_prompt = len(handoff.request.prompt_token_ids)
        if handoff.kv is not None and self.scheduler.add_running(request, num_prompt):
            self.runner.import_blocks(request.block_ids, handoff.kv)
            return True
        self.scheduler.add(request)
        return False

    def _admit(self, spec: EngineRequest) -> Request:
        if len(self.scheduler.waiting) >= self.config.max_queued_requests:
            raise EngineOverloaded(f"{len(self.scheduler.waiting)} requests already wait for this engine")
        if spec.request_id in self.requests or spec.request_id in self.parked:
            raise RequestRejected(f"request id {spec.request_id!r} is already in this engine")
        num_tokens = len(spec.prompt_token_ids) + spec.policy.max_tokens
        if not spec.prompt_token_ids:
            raise RequestRejected("the prompt is empty")
        if num_tokens > self.max_model_len:
            raise RequestRejected(f"prompt + max_tokens = {num_tokens} exceeds max_model_len {self.max_model_len}")
        if self.pool.blocks_for(num_tokens) > self.pool.num_blocks:
            raise RequestRejected(f"prompt + max_tokens = {num_tokens} tokens exceeds the KV cache")
        request = Request(spec)
        self.requests[spec.request_id] = request
        return request

    # --- the loop --------------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[StepOutput]:
        batch = self.scheduler.schedule()
        if batch is None:
            return []
        tokens = self.runner.run(batch)
        outputs = []
        for request, token in zip(batch.requests, tokens):
            request.num_computed_tokens = request.num_tokens
            cause = request.append(token, self.max_model_len)
            outputs.append(StepOutput(request.request_id, (token,), cause))
            if cause is not None:
                self._finish(request, cause)
            elif self.config.role == Role.PREFILL:
                self._park(request)
        return outputs

    def _finish(self, request: Request, cause: StopCause) -> None:
        request.finish = cause
        self._drop(request)

    def _drop(self, request: Request) -> None:
        """Forget the request and give its blocks back, whatever queue it is in."""
        if request.status == Status.PARKED:
            self.parked.pop(request.request_id)
            self.pool.free(request.block_ids)
            request.block_ids = []
            request.set_status(Status.FINISHED)
        else:
            self.scheduler.finish(request)
        self.requests.pop(request.request_id, None)

    def _park(self, request: Request) -> None:
        self.scheduler.park(request)
        self.requests.pop(request.request_id)
        self.parked[request.request_id] = request

    # --- prefill role: export --------------------------------------------------------------------

    def parked_block_ids(self, request_id: str) -> list[int]:
        return list(self.parked[request_id].block_ids)

    def export_shape(self, request_id: str) -> tuple[int, ...]:
        """The shape `export_kv` will have, without copying anything."""
        shape = list(self.runner.kv_cache.shape)
        shape[2] = len(self.parked[request_id].block_ids)
        return tuple(shape)

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.runner.kv_cache.dtype

    def export_kv(self, request_id: str) -> torch.Tensor:
        """The prompt's KV, packed: `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`."""
        return self.runner.export_blocks(self.parked[request_id].block_ids)

    def release(self, request_id: str) -> bool:
        """Free a parked request's blocks (decode acknowledged, or the lease expired)."""
        request = self.parked.get(request_id)
        if request is None:
            return False
        self._drop(request)
        return True

    # --- cancellation and stats -------------------------------------------------------------------

    def abort(self, request_id: str) -> bool:
        request = self.requests.get(request_id) or self.parked.get(request_id)
        if request is None:
            return False
        self._finish(request, Abort())
        return True

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            num_parked=len(self.parked),
            num_blocks=self.pool.num_blocks,
            num_free_blocks=self.pool.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
        )
