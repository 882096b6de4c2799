"""One request's share of a step, as the runner reads it (a `ScheduledRequest`): the tokens to compute,
the positions whose logits it samples, each with its `SamplingRow`, and the prompt positions it scores. Built
from the request's state, which it only reads: the scheduler decides how many tokens and which blocks.
"""

from __future__ import annotations

from pegaserve.request import RequestState
from pegaserve.sample.grammar import Grammars
from pegaserve.sample.processing import SamplingRow, bad_word_bans
from pegaserve.sched.output import SampleAt, ScheduledRequest


def scheduled_request(request: RequestState, num_new: int, block_ids: tuple[int, ...],
                      grammars: Grammars | None = None) -> ScheduledRequest:
    """`request`'s share of a step that computes its next `num_new` tokens (its known ones, then its
    drafts) over the blocks `block_ids`: the positions to sample and the prompt positions to score.
    `grammars` makes the constraint of a request with a grammar (it has no drafts)."""
    start = request.num_computed_tokens
    known_end = min(start + num_new, request.num_tokens)
    token_ids = request.token_ids(start, known_end)
    drafts = request.draft_token_ids
    if drafts:
        token_ids = [*token_ids, *drafts]
    samples: tuple[SampleAt, ...] = ()
    if known_end == request.num_tokens and request.policy.max_tokens > 0:
        last = known_end - 1 - start  # the offset of the newest token: its logits give the next
        if request.forks:  # the choices of one prompt sample from its last position
            samples = tuple(SampleAt(last, _row(c, 0, grammars=grammars)) for c in (request, *request.forks))
        else:
            n = request.num_output_tokens
            samples = tuple(
                SampleAt(last + j, _row(request, n + j, drafts[:j], drafts[j] if j < len(drafts) else None, grammars))
                for j in range(len(drafts) + 1)
            )
    score_from, targets, num_top = _score_targets(request, start, known_end)
    return ScheduledRequest(
        request.request_id, tuple(token_ids), start, block_ids, samples, score_from, targets, num_top
    )


def _row(request: RequestState, num_output: int, drafts: tuple[int, ...] = (), draft: int | None = None,
         grammars: Grammars | None = None) -> SamplingRow:
    """The row that samples `request`'s output token `num_output`: the `drafts` before it count as output
    (for the penalties and bad words), and `draft` is proposed for it."""
    params = request.sampling
    masked = request.policy.masked_token_ids(num_output)
    if params.bad_words:
        masked |= bad_word_bans(params.bad_words, request.output_token_ids + drafts)
    bitmask = None
    if params.grammar is not None:
        if request.constraint is None:
            request.constraint = grammars.constraint(params.grammar)
        bitmask = request.constraint.bitmask(request.output_token_ids)
    return SamplingRow(
        params, num_output, masked,
        output_token_ids=request.output_token_ids + drafts if params.has_penalties else (),
        prompt_token_ids=request.engine_request.prompt_token_ids if params.repetition_penalty != 1.0 else (),
        draft_token_id=draft,
        token_bitmask=bitmask,
    )  # fmt: skip


def _score_targets(request: RequestState, start: int, end: int) -> tuple[int, tuple[int, ...], int]:
    """Prompt logprobs: position p predicts prompt token p + 1; score the ones still missing."""
    scores = request.prompt_scores
    if scores is None or len(scores) >= request.num_prompt_tokens:
        return 0, (), 0
    first = max(start, len(scores) - 1)  # the first source position still to score
    last = min(end, request.num_prompt_tokens - 1)
    targets = request.engine_request.prompt_token_ids[first + 1 : last + 1]
    return first - start, tuple(targets), request.engine_request.num_prompt_logprobs or 0
