"""Sampling: batched over a step's logits, one row per request.

Processing, in vLLM's order, on a copy of just the rows that need it (the caller's logits are never
changed): allowed_token_ids and a grammar (every other token masked), logit_bias (added), the
min_tokens mask (docs/contract.md rule 6) and bad words, repetition_penalty over
prompt + output (HF: each distinct token's logit divided by p if positive, else multiplied), then
frequency and presence penalties over the output (OpenAI: minus frequency * count, minus presence
once). The masks are written after the penalties, which changes nothing for valid values (they keep
-inf at -inf) and lets them win over any of them. Greedy rows then take the argmax; sampled rows are
divided by their temperature (inside each exp: no scaled copy), filtered by top-k, top-p (over the
top-k renormalized distribution) and min_p (relative to the best token), and drawn. Logprobs are
the log-softmax of the raw logits, as vLLM reports them by default; a row gets its sampled token's
only where it is wanted (`SamplingRow.wants_logprob`: asked for).

A draw is an inverse-CDF sample with one uniform per row, hashed from (seed, position), so a seeded
row's token depends on nothing else in the batch, on preemption, or on which replica (prefill or
decode) samples it. Nor on a speculative draft (n-gram, or a request's predicted output): the row is
drawn as it would be without one, and the scheduler accepts the draft when the draw is the draft.
That is an exact sample from p, accepted with probability p(draft) as rejection sampling's is for a
one-token proposal, and a seeded request's tokens are the same with drafts or without. (Where the
runner has the screened LM head, a sampled row without filter or logprob is drawn by rejection from
upper bounds of its processed logits instead, with the same law and more uniforms of the same
hash: screened.py.)

A vocabulary is ~150k wide, so passes over it dominate a small model's step. Every row costs a
chunked max that finds the argmax; a chunked exp2-sum gives both the log-normalizer and the inverse
CDF's first level (the mass of each 1024-token cell; the second level looks inside one cell), for
the rows that want a logprob and the temperature-1 rows without processing or filters, which are
drawn from it: a greedy row that wants no logprob costs the max alone (a greedy decode step at
batch 16 on the default model: ~0.9 ms of sampling instead of ~1.5). Any other sampled row costs
one more exp2-sum, and a row with processing a copy of its logits too. Filters never write:
each is a per-row lower bound on the logits kept, top-k's from the k cells with the best maxima,
top-p's from a histogram of the mass and a sort of one bucket of it (never of a row), min_p's in
closed form. Tokens more than 80 nats below a row's best weigh nothing.

`SamplingRow` and the processing live in processing.py, the temperature scales and filters in
filters.py, the draw in draw.py, and the passes over the vocabulary in passes.py (their kernel in
pegaserve/cpu/vocab_passes.py). This module plans which rows take which path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pegaserve.messages import SampledToken, TokenScore
from pegaserve.sample.draw import draw_tokens
from pegaserve.sample.filters import has_filters, lower_bounds, temperature_scales, top_logits
from pegaserve.sample.passes import (
    argmax_rows,
    cell_masses,
    finite_or_zero,
    log_normalizers,
    max_argmax_rows,
    normalizers_from_masses,
    select_rows,
    unless_all,
)
from pegaserve.sample.processing import SamplingRow, edit_rows

_SCORE_ROWS = 64  # prompt rows scored at a time: bounds the [rows, vocab] temporaries


def argmax_only(row: SamplingRow) -> bool:
    """Whether the row's token is the raw logits' argmax and nothing else is read of them: greedy,
    no processing, no logprob wanted. `sample` gives it `SampledToken(argmax, None)`."""
    return row.params.greedy and not row.edited and not row.wants_logprob


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """One token per row of `logits` ([num_rows, vocab], float32, CPU; never modified)."""
    logits = logits.contiguous()
    num_rows = logits.shape[0]
    plan = _Plan.of(rows, logits.shape[1])
    raw_max, raw_argmax = max_argmax_rows(logits)  # [num_rows, 1], [num_rows]
    # temperature-1 cell masses, for the rows that read them: a logprob's normalizer, a plain draw
    normalizers = torch.full((num_rows,), float("nan"))  # found for the massed rows only
    if plan.massed:
        massed = torch.tensor(plan.massed)
        raw_masses = cell_masses(logits, finite_or_zero(raw_max[massed]), None, unless_all(massed, num_rows))
        normalizers[massed] = normalizers_from_masses(raw_masses, raw_max[massed])
    token_ids = raw_argmax.clone()  # greedy rows without processing keep theirs
    if plan.unedited:
        index = torch.tensor(plan.unedited)
        picked = [rows[i] for i in plan.unedited]
        reused = raw_masses[plan.reused_masses] if plan.num_reused else None
        row_ids = unless_all(index, num_rows)
        token_ids[index] = _sample_rows(logits, row_ids, picked, raw_max[index], raw_argmax[index], reused)
    if plan.edited:
        index = torch.tensor(plan.edited)
        token_ids[index] = _sample_edited(logits.index_select(0, index), [rows[i] for i in plan.edited], plan)
    logprobs = (logits.gather(1, token_ids[:, None])[:, 0] - normalizers).tolist()
    tops = alternatives(logits, normalizers, rows)
    return [SampledToken(t, lp if row.wants_logprob else None, top)
            for t, lp, top, row in zip(token_ids.tolist(), logprobs, tops, rows)]


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """A copy of `logits` with each row's logit_bias, penalties and min_tokens mask applied: what a
    greedy row takes the argmax of, and a sampled one divides by its temperature."""
    processed = logits.clone(memory_format=torch.contiguous_format)
    edit_rows(processed, list(rows))
    return processed


def score_tokens(logits: torch.Tensor, target_ids: Sequence[int], num_top: int) -> list[TokenScore]:
    """Row i of `logits` ([R, vocab]) scores `target_ids[i]` by the raw log-softmax, with its rank
    and the row's `num_top` best tokens."""
    assert logits.shape[0] == len(target_ids), (logits.shape, len(target_ids))
    scores: list[TokenScore] = []
    for first in range(0, len(target_ids), _SCORE_ROWS):
        part = logits[first : first + _SCORE_ROWS].contiguous()  # [rows, vocab]
        targets = torch.tensor(target_ids[first : first + _SCORE_ROWS], dtype=torch.long)[:, None]
        normalizers = log_normalizers(part)
        target_logits = part.gather(1, targets)  # [rows, 1]
        ranks = (part > target_logits).sum(-1).add_(1).tolist()
        logprobs = (target_logits[:, 0] - normalizers).tolist()
        tops = _top_logprobs(part, normalizers, [num_top] * part.shape[0])
        scores += map(TokenScore, targets[:, 0].tolist(), logprobs, ranks, tops)
    return scores


def alternatives(logits: torch.Tensor, normalizers: torch.Tensor, rows: Sequence[SamplingRow],
                 top_logprobs=None) -> list[tuple[tuple[int, float], ...]]:
    """Each row's alternatives with their raw logprobs: its `num_top_logprobs` best tokens, best
    first (`top_logprobs(logits, normalizers, counts)`, this module's by default), or the logprobs
    of its `logprob_token_ids`, in their order."""
    listed = [row.params.logprob_token_ids for row in rows]
    tops = (top_logprobs or _top_logprobs)(logits, normalizers, [0 if ids else row.params.num_top_logprobs or 0
                                                                for row, ids in zip(rows, listed)])
    for i, ids in enumerate(listed):
        if ids:
            values = (logits[i, list(ids)] - normalizers[i]).tolist()
            tops[i] = tuple(zip(ids, values))
    return tops


def _top_logprobs(
    logits: torch.Tensor, normalizers: torch.Tensor, counts: list[int]
) -> list[tuple[tuple[int, float], ...]]:
    """Each row's `counts[i]` best tokens with their raw logprobs, best first (batched)."""
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(counts)
    wanted = [i for i, n in enumerate(counts) if n > 0]
    if not wanted:
        return tops
    index = torch.tensor(wanted)
    values, ids = top_logits(logits, unless_all(index, len(counts)), max(counts[i] for i in wanted))
    values = (values - normalizers[index, None]).tolist()
    for r, (i, top_ids) in enumerate(zip(wanted, ids.tolist())):
        tops[i] = tuple(zip(top_ids[: counts[i]], values[r][: counts[i]]))
    return tops


# --- which rows take which path ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """Rows by path: greedy rows without processing keep the raw argmax; sampled rows without it are
    drawn from the raw logits; the rest get a processed copy of their logits. The raw cell masses are
    found for the rows that read them: the plain temperature-1 draws, and every row whose sampled
    token's logprob is wanted (`SamplingRow.wants_logprob`)."""

    unedited: list[int]  # sampled without processing
    num_reused: int  # leading unedited rows at temperature 1 with no filter: the raw cell masses are theirs
    edited: list[int]  # rows with processing, the sampled ones first
    num_edited_sampled: int
    massed: list[int]  # the rows whose raw cell masses are found, in order
    reused_masses: list[int]  # where the reused rows' masses lie among theirs

    @staticmethod
    def of(rows: Sequence[SamplingRow], vocab: int) -> _Plan:
        reused, unedited, sampled, greedy, massed = [], [], [], [], []
        for i, row in enumerate(rows):
            params = row.params
            plain_draw = False
            if row.edited:
                (greedy if params.greedy else sampled).append(i)
            elif not params.greedy:
                plain_draw = params.temperature == 1.0 and not has_filters(params, vocab)
                (reused if plain_draw else unedited).append(i)
            if plain_draw or row.wants_logprob:
                massed.append(i)
        where = {row: k for k, row in enumerate(massed)}
        return _Plan(reused + unedited, len(reused), sampled + greedy, len(sampled), massed, [where[i] for i in reused])


def _sample_edited(work: torch.Tensor, rows: list[SamplingRow], plan: _Plan) -> torch.Tensor:
    """Tokens of the rows with processing; `work` is their own copy of the logits."""
    edit_rows(work, rows)
    argmax = argmax_rows(work)  # the greedy rows' tokens
    num_sampled = plan.num_edited_sampled
    if num_sampled:
        sampled = work[:num_sampled]
        row_max = sampled.gather(1, argmax[:num_sampled, None])
        argmax[:num_sampled] = _sample_rows(sampled, None, rows[:num_sampled], row_max, argmax[:num_sampled], None)
    return argmax


def _sample_rows(
    source: torch.Tensor,
    row_ids: torch.Tensor | None,
    rows: Sequence[SamplingRow],
    row_max: torch.Tensor,
    row_argmax: torch.Tensor,
    reused_masses: torch.Tensor | None,
) -> torch.Tensor:
    """Draw each of `rows` from its row of `source` (`row_ids`; None: all, in order), given each
    one's max (`[n, 1]`) and argmax; the first rows' cell masses may be known (`reused_masses`)."""
    shift, scale = finite_or_zero(row_max), temperature_scales(rows)  # [n, 1] each
    lower = lower_bounds(source, row_ids, rows, row_max, shift, scale)
    num_reused = 0 if reused_masses is None else reused_masses.shape[0]
    masses = reused_masses
    if num_reused < len(rows):
        rest = select_rows(row_ids, torch.arange(num_reused, len(rows)), source.shape[0])
        bounded = lower[num_reused:] if bool((lower > float("-inf")).any()) else None
        found = cell_masses(source, shift[num_reused:], scale[num_reused:], rest, bounded)
        masses = found if masses is None else torch.cat([masses, found])
    return draw_tokens(source, row_ids, row_max, shift, scale, lower, masses, rows, row_argmax)
