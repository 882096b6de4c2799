"""The messages between the scheduler and the model runner, one pair per engine step.

`SchedulerOutput` says, per request, which tokens to compute at which positions, over which
blocks, and which positions' logits to sample or score; the runner answers with a `RunnerOutput`.
Both are plain frozen data: the runner never reads the scheduler's live request objects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pegaserve.messages import SampledToken, TokenScore

if TYPE_CHECKING:
    from pegaserve.sample.processing import SamplingRow


@dataclass(frozen=True)
class SampleAt:
    """Sample one token from the logits at `offset` among the request's scheduled tokens. Several
    rows may share an offset: the choices of one prompt sample from its last position."""

    offset: int
    row: SamplingRow


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: `token_ids` sit at positions `start .. start + len - 1` (a
    prefill chunk, a decode token, or a decode token and its speculative drafts)."""

    request_id: str
    token_ids: tuple[int, ...]
    start: int
    block_ids: tuple[int, ...]  # the block table, covering every scheduled position
    samples: tuple[SampleAt, ...] = ()
    score_from: int = 0  # prompt logprobs: offsets score_from.. predict `score_targets`
    score_targets: tuple[int, ...] = ()
    num_top_scores: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    requests: tuple[ScheduledRequest, ...]
    block_copies: tuple[tuple[int, int], ...] = ()  # copy-on-write (source, destination), made first

    @property
    def num_batched_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)


@dataclass(frozen=True)
class RunnerOutput:
    """Per scheduled request, in order: its sampled tokens (one per `SampleAt`) and its prompt
    scores (one per score target)."""

    sampled: tuple[tuple[SampledToken, ...], ...]
    scores: tuple[tuple[TokenScore, ...], ...]
