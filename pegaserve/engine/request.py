"""The engine's vocabulary: what a request asks for, its mutable state, and what a step emits.

`Request` is owned by the engine's scheduler; only its methods change it. Everything that crosses a
boundary (`EngineRequest` in, `SampledToken`/`StepOutput` out, `Handoff` between roles) is frozen.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pegaserve.stop import Length, StopCause, StopPolicy


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    seed: int | None = None
    num_top_logprobs: int = 0  # top-N alternatives returned per token; the sampled logprob always is

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class EngineRequest:
    """What the ingress hands an engine: token ids only (stop strings stay with the ingress)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    policy: StopPolicy
    arrival_s: float = field(default_factory=time.time)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True)
class StepOutput:
    """One request's share of one engine step: its new tokens, and its finish if it finished.

    When `finish` is a token-level cause (`Eos`/`Token`/`Length`), the last token is its trigger.
    `finish_pending` marks a last token whose terminal decision has not been made yet; a consumer
    must not show that token until a later message decides it (docs/CONTRACT.md rule 18).
    """

    request_id: str
    tokens: tuple[SampledToken, ...]
    finish: StopCause | None = None
    finish_pending: bool = False

    def then(self, later: "StepOutput") -> "StepOutput":
        """This message and a later one of the same request as one (a consumer that fell behind)."""
        assert self.request_id == later.request_id and self.finish is None and not self.finish_pending
        return StepOutput(self.request_id, self.tokens + later.tokens, later.finish, later.finish_pending)


@dataclass(frozen=True)
class Handoff:
    """What prefill hands decode (rule 22): the first token, the policy and the prompt's KV blocks.

    `kv` is the packed prompt KV, `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`,
    or None when decode must recompute the prompt (transfer failed or the lease expired).
    """

    request: EngineRequest
    first_token: SampledToken
    kv: object | None = None


class Status(enum.Enum):
    WAITING = "waiting"  # queued for prefill (or for recompute after preemption)
    RUNNING = "running"  # holds blocks, decoding
    PARKED = "parked"  # prefill role: first token sampled, blocks held for export
    FINISHED = "finished"

    def can_become(self, new: "Status") -> bool:
        return new in _TRANSITIONS[self]


_TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.WAITING: frozenset({Status.RUNNING, Status.FINISHED}),
    Status.RUNNING: frozenset({Status.WAITING, Status.PARKED, Status.FINISHED}),
    Status.PARKED: frozenset({Status.FINISHED}),
    Status.FINISHED: frozenset(),
}


class Request:
    """A request's engine-side state. `num_computed_tokens` is its one progress counter: how many
    of `all_token_ids` have their KV in the cache."""

    def __init__(self, spec: EngineRequest) -> None:
        self.spec = spec
        self.status = Status.WAITING
        self.block_ids: list[int] = []  # the block table
        self.num_computed_tokens = 0
        self._output: list[SampledToken] = []
        self.finish: StopCause | None = None

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def output(self) -> tuple[SampledToken, ...]:
        return tuple(self._output)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output)

    @property
    def num_tokens(self) -> int:
        return len(self.spec.prompt_token_ids) + len(self._output)

    def all_token_ids(self) -> list[int]:
        return [*self.spec.prompt_token_ids, *(t.token_id for t in self._output)]

    def set_status(self, new: Status) -> None:
        assert self.status.can_become(new), f"{self.request_id}: {self.status} -> {new}"
        self.status = new

    def append(self, token: SampledToken, max_model_len: int) -> StopCause | None:
        """Record a sampled token and classify it (rule 1: one at a time, in order).
        A full context ends the request with `Length` when no other rule fired."""
        assert self.finish is None, "no token after the terminal one (rule 1)"
        self._output.append(token)
        cause = self.spec.policy.classify(token.token_id, len(self._output))
        if cause is None and self.num_tokens >= max_model_len:
            cause = Length()
        self.finish = cause
        return cause
