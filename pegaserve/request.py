"""A request's engine-side state: its `Status` and its legal transitions, and `RequestState`, owned by
the scheduler (only its methods change it)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from pegaserve.messages import EngineRequest, SampledToken, TokenScore
from pegaserve.stop import Length, StopCause, StopPolicy

if TYPE_CHECKING:
    from pegaserve.sample.grammar import Constraint


class Status(enum.Enum):
    WAITING = "waiting"  # queued for prefill (or for recompute after preemption)
    RECEIVING = "receiving"  # decode role: blocks allocated, the prompt's KV arriving from prefill
    RUNNING = "running"  # holds blocks; prefilling in chunks, then decoding
    PARKED = "parked"  # prefill role: first token sampled, blocks held for export
    FINISHED = "finished"

    def can_become(self, new: "Status") -> bool:
        return new in _TRANSITIONS[self]


_TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.WAITING: frozenset({Status.RUNNING, Status.RECEIVING, Status.FINISHED}),
    Status.RECEIVING: frozenset({Status.RUNNING, Status.WAITING, Status.FINISHED}),
    Status.RUNNING: frozenset({Status.WAITING, Status.PARKED, Status.FINISHED}),
    Status.PARKED: frozenset({Status.FINISHED}),
    Status.FINISHED: frozenset(),
}


class RequestState:
    """One choice's engine-side state, owned by the scheduler.

    `num_computed_tokens` is its one progress counter: how many of `all_token_ids()` have their KV
    in the cache. Its blocks are not here: the KV cache manager owns every block table.
    """

    def __init__(self, engine_request: EngineRequest, index: int = 0) -> None:
        self.engine_request = engine_request
        self.index = index
        self.request_id = engine_request.choice_id(index)
        self.sampling = engine_request.choice_sampling(index)
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache (None: not looked up)
        self.draft_token_ids: tuple[int, ...] = ()  # speculative proposals for the next step
        self.drafts_predicted = False  # whether they come from the request's predicted output
        self.prompt_scores: list[TokenScore | None] | None = None if engine_request.num_prompt_logprobs is None else [None]
        self.forks: list[RequestState] = []  # choices waiting to share this one's prefill
        self.constraint: Constraint | None = None  # its grammar's matcher, made when it first samples here
        self._output: list[SampledToken] = []
        self._output_ids: list[int] = []
        self.finish: StopCause | None = None

    @property
    def policy(self) -> StopPolicy:
        return self.engine_request.policy

    @property
    def output(self) -> tuple[SampledToken, ...]:
        return tuple(self._output)

    @property
    def output_token_ids(self) -> tuple[int, ...]:
        return tuple(self._output_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.engine_request.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.engine_request.prompt_token_ids) + len(self._output)

    def all_token_ids(self) -> list[int]:
        return [*self.engine_request.prompt_token_ids, *self._output_ids]

    def token_ids(self, start: int, end: int) -> list[int]:
        """`all_token_ids()[start:end]` without copying the whole sequence."""
        prompt = self.engine_request.prompt_token_ids
        if start >= len(prompt):
            return self._output_ids[start - len(prompt) : end - len(prompt)]
        return [*prompt[start:end], *self._output_ids[: max(0, end - len(prompt))]]

    def set_status(self, new: Status) -> None:
        assert self.status.can_become(new), f"{self.request_id}: {self.status} -> {new}"
        self.status = new

    def append(self, token: SampledToken, max_model_len: int) -> StopCause | None:
        """Record a sampled token and classify it (rule 1: one at a time, in order).
        A full context ends the request with `Length` when no other rule fired."""
        assert self.finish is None, "no token after the terminal one (rule 1)"
        self._output.append(token)
        self._output_ids.append(token.token_id)
        cause = self.engine_request.policy.classify(token.token_id, len(self._output))
        if cause is None and self.num_tokens >= max_model_len:
            cause = Length()
        self.finish = cause
        return cause
