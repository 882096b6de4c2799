"""Sampling: batched over a step's logits, one row per request.

Processing, in vLLM's order, on a copy of just the rows that need it (the caller's logits are never
changed): logit_bias (added), the min_tokens mask (docs/CONTRACT.md rule 6), repetition_penalty over
prompt + output (HF: each distinct token's logit divided by p if positive, else multiplied), then
frequency and presence penalties over the output (OpenAI: minus frequency * count, minus presence
once). The mask is written after the penalties, which changes nothing for valid values (they keep
-inf at -inf) and lets it win over any of them. Greedy rows then take the argmax; sampled rows are
divided by their temperature (inside each exp: no scaled copy), filtered by top-k, top-p (over the
top-k renormalized distribution) and min_p (relative to the best token), and drawn. Logprobs are
always the log-softmax of the raw logits, as vLLM reports them by default.

A draw is an inverse-CDF sample with one uniform per row, hashed from (seed, position), so a seeded
row's token depends on nothing else in the batch, on preemption, or on which replica (prefill or
decode) samples it. A speculative draft's mass comes first in the CDF: the same uniform accepts the
draft with probability p(draft) and otherwise samples p without it, renormalized, which is an exact
sample from p either way.

A vocabulary is ~150k wide, so passes over it dominate a small model's step. Every row costs two: a
chunked max that finds the argmax, and a chunked exp2-sum that gives both the log-normalizer and the
inverse CDF's first level (the mass of each 1024-token cell); the second level looks inside one
cell. A temperature-1 row without processing or filters is drawn from those; any other sampled row
costs one more exp2-sum, and a row with processing a copy of its logits too. Filters never write:
each is a per-row lower bound on the logits kept, top-k's from the k cells with the best maxima,
top-p's from a histogram of the mass and a sort of one bucket of it (never of a row), min_p's in
closed form. Tokens more than 80 nats below a row's best weigh nothing.
"""

from __future__ import annotations

import array
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from pegaserve.engine import vocab_passes
from pegaserve.engine.request import SampledToken, SamplingParams

_ARGMAX_CHUNK = 1024
_CELL = 1024  # tokens per cell of the inverse CDF's first level
_PASS_COLUMNS = 16 * _CELL  # columns per exp-sum pass through one small scratch
_LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); torch's CPU exp2 is ~4x faster than exp
_FLOOR = -80.0 * _LOG2_E  # exp() of under -80 is < 2e-35: weightless, and kept out of slow denormals
_TOP_P_BUCKETS = 4096  # histogram slices of the exponent range; top-p sorts one slice's tokens
_MAX_TEMPERATURE = 1e30  # keeps logits / temperature finite, and -inf at -inf
_SCORE_ROWS = 64  # prompt rows scored at a time: bounds the [rows, vocab] temporaries
_MASK64 = (1 << 64) - 1
_UNSEEDED = random.SystemRandom()  # unseeded rows' uniforms; stateless, so no hidden state


@dataclass(frozen=True)
class SamplingRow:
    """One row of a step's logits: whose sampling it is and the context it reads. The engine fills
    `output_token_ids` only when `params.has_penalties`, `prompt_token_ids` only for
    repetition_penalty; the sampler reads them only then."""

    params: SamplingParams
    num_output_tokens: int  # the sampled token's 0-based position among generated ones: keys the seed
    masked_token_ids: frozenset[int] = frozenset()  # min_tokens masking (docs/CONTRACT.md rule 6)
    output_token_ids: tuple[int, ...] = ()  # generated so far (presence/frequency/repetition)
    prompt_token_ids: tuple[int, ...] = ()  # repetition_penalty covers prompt + output
    draft_token_id: int | None = None  # a speculative proposal for this position

    @property
    def edited(self) -> bool:
        """Whether its logits differ from the raw ones before temperature."""
        return bool(self.masked_token_ids or self.params.logit_bias) or self.params.has_penalties


@dataclass(frozen=True)
class TokenScore:
    """A given token under one row of logits (prompt logprobs, echo)."""

    token_id: int
    logprob: float  # the raw log-softmax
    rank: int  # 1 + the number of tokens with a strictly greater logit
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """One token per row of `logits` ([num_rows, vocab], float32, CPU; never modified)."""
    logits = logits.contiguous()
    num_rows = logits.shape[0]
    plan = _Plan.of(rows, logits.shape[1])
    raw_max, raw_argmax = max_argmax_rows(logits)  # [num_rows, 1], [num_rows]
    raw_masses = _cell_masses(logits, _finite(raw_max))  # [num_rows, num_cells]: temperature 1
    normalizers = _normalizers(raw_masses, raw_max)  # [num_rows]
    token_ids = raw_argmax.clone()  # greedy rows without processing keep theirs
    if plan.unedited:
        index = torch.tensor(plan.unedited)
        picked = [rows[i] for i in plan.unedited]
        reused = raw_masses[index[: plan.num_reused]]
        row_ids = _unless_all(index, num_rows)
        token_ids[index] = _sample_rows(logits, row_ids, picked, raw_max[index], raw_argmax[index], reused)
    if plan.edited:
        index = torch.tensor(plan.edited)
        token_ids[index] = _sample_edited(logits.index_select(0, index), [rows[i] for i in plan.edited], plan)
    chosen = (logits.gather(1, token_ids[:, None])[:, 0] - normalizers).tolist()
    tops = _top_logprobs(logits, normalizers, [row.params.num_top_logprobs for row in rows])
    return [SampledToken(t, lp, top) for t, lp, top in zip(token_ids.tolist(), chosen, tops)]


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """A copy of `logits` with each row's logit_bias, penalties and min_tokens mask applied: what a
    greedy row takes the argmax of, and a sampled one divides by its temperature."""
    processed = logits.clone(memory_format=torch.contiguous_format)
    _edit(processed, list(rows))
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


# --- which rows take which path ---------------------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    """Rows by path: greedy rows without processing keep the raw argmax; sampled rows without it are
    drawn from the raw logits; the rest get a processed copy of their logits."""

    unedited: list[int]  # sampled without processing
    num_reused: int  # leading unedited rows at temperature 1 with no filter: the raw cell masses are theirs
    edited: list[int]  # rows with processing, the sampled ones first
    num_edited_sampled: int

    @staticmethod
    def of(rows: Sequence[SamplingRow], vocab: int) -> _Plan:
        reused, unedited, sampled, greedy = [], [], [], []
        for i, row in enumerate(rows):
            params = row.params
            if row.edited:
                (greedy if params.greedy else sampled).append(i)
            elif not params.greedy:
                (reused if params.temperature == 1.0 and not _filters(params, vocab) else unedited).append(i)
        return _Plan(reused + unedited, len(reused), sampled + greedy, len(sampled))


def _filters(params: SamplingParams, vocab: int) -> bool:
    return params.top_p < 1.0 or 0 < params.top_k < vocab or params.min_p > 0.0


def _sample_edited(work: torch.Tensor, rows: list[SamplingRow], plan: _Plan) -> torch.Tensor:
    """Tokens of the rows with processing; `work` is their own copy of the logits."""
    _edit(work, rows)
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
    shift, scale = _finite(row_max), _scales(rows)  # [n, 1] each
    lower = _lower_bounds(source, row_ids, rows, row_max, shift, scale)
    num_reused = 0 if reused_masses is None else reused_masses.shape[0]
    masses = reused_masses
    if num_reused < len(rows):
        rest = _select(row_ids, torch.arange(num_reused, len(rows)), source.shape[0])
        bounded = lower[num_reused:] if bool((lower > float("-inf")).any()) else None
        found = _cell_masses(source, shift[num_reused:], scale[num_reused:], rest, bounded)
        masses = found if masses is None else torch.cat([masses, found])
    return _draw(source, row_ids, row_max, shift, scale, lower, masses, rows, row_argmax)


def _select(row_ids: torch.Tensor | None, picked: torch.Tensor, num_source_rows: int) -> torch.Tensor | None:
    """The source rows of the `picked` ones among `row_ids` (None: all rows of the source, in order)."""
    return _unless_all(picked if row_ids is None else row_ids[picked], num_source_rows)


def _unless_all(row_ids: torch.Tensor, num_rows: int) -> torch.Tensor | None:
    """None when `row_ids` are all `num_rows` rows in order (then no gather is needed)."""
    if len(row_ids) == num_rows and bool((row_ids == torch.arange(num_rows)).all()):
        return None
    return row_ids


# --- processing (each phase batched over the rows that use it; a no-op when none do) -------------


def _edit(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    _add_bias(work, rows)
    _apply_penalties(work, rows)
    _mask(work, rows)


def _add_bias(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    biased = [(j, row.params.logit_bias) for j, row in enumerate(rows) if row.params.logit_bias]
    if biased:
        index = _flat_index(work.shape[1], [(j, [t for t, _ in bias]) for j, bias in biased])
        values = torch.tensor([b for _, bias in biased for _, b in bias], dtype=work.dtype)
        work.view(-1).index_put_((index,), values, accumulate=True)


def _mask(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    masked = [(j, row.masked_token_ids) for j, row in enumerate(rows) if row.masked_token_ids]
    if masked:
        work.view(-1).index_fill_(0, _flat_index(work.shape[1], masked), float("-inf"))


def _apply_penalties(work: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab, flat = work.shape[1], work.view(-1)
    repeated = [(j, row) for j, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    if repeated:
        # A token seen twice is read twice and written twice with the same value: no need to dedupe.
        index = _flat_index(vocab, [(j, row.prompt_token_ids + row.output_token_ids) for j, row in repeated])
        penalty = torch.tensor([row.params.repetition_penalty for row in rows], dtype=work.dtype)[index // vocab]
        values = flat[index]
        flat[index] = torch.where(values > 0, values / penalty, values * penalty)
    counted = [
        (j, row.output_token_ids)
        for j, row in enumerate(rows)
        if (row.params.frequency_penalty != 0.0 or row.params.presence_penalty != 0.0) and row.output_token_ids
    ]
    if counted:
        index, counts = _flat_index(vocab, counted).unique(return_counts=True)
        row_of = index // vocab
        frequency = torch.tensor([row.params.frequency_penalty for row in rows], dtype=work.dtype)[row_of]
        presence = torch.tensor([row.params.presence_penalty for row in rows], dtype=work.dtype)[row_of]
        flat.index_add_(0, index, -(frequency * counts + presence))


def _flat_index(vocab: int, id_lists: Iterable[tuple[int, Iterable[int]]]) -> torch.Tensor:
    """Indices into a flattened contiguous `[rows, vocab]` tensor of each (row, token ids)."""
    row_ids, parts = [], []
    for j, token_ids in id_lists:
        row_ids.append(j)
        parts.append(_id_tensor(token_ids))
    ids = torch.cat(parts)
    assert not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < vocab), "token id outside the vocabulary"
    offsets = torch.tensor(row_ids) * vocab
    return ids + offsets.repeat_interleave(torch.tensor([len(p) for p in parts]))


def _id_tensor(token_ids: Iterable[int]) -> torch.Tensor:
    # through an array: ~4x faster than torch.tensor() on a tuple of a long prompt's ids
    ids = array.array("q", token_ids)
    return torch.frombuffer(ids, dtype=torch.long) if ids else torch.empty(0, dtype=torch.long)


# --- filters: each row's lowest kept logit (-inf: keeps all) ------------------------------------------


def _scales(rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`[n, 1]`: what multiplies `logit - max` inside exp2(): log2(e) / temperature."""
    return torch.tensor([[_LOG2_E / min(row.params.temperature, _MAX_TEMPERATURE)] for row in rows])


def _lower_bounds(
    source: torch.Tensor,
    row_ids: torch.Tensor | None,
    rows: Sequence[SamplingRow],
    row_max: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor:
    """`[n, 1]`: the lowest logit that top-k, then top-p (over what top-k keeps), then min_p keep;
    each keeps a set of best tokens, so together they keep those at or above the highest bound."""
    num_rows, vocab = len(rows), source.shape[1]
    lower = torch.full((num_rows, 1), float("-inf"))
    top_k = [i for i, row in enumerate(rows) if 0 < row.params.top_k < vocab]
    if top_k:
        picked = torch.tensor(top_k)
        ks = [rows[i].params.top_k for i in top_k]
        lower[picked] = _kth_largest(source, _select(row_ids, picked, source.shape[0]), ks)
    finite = row_max[:, 0].isfinite().tolist()  # a row without a finite max falls back to its argmax
    top_p = [i for i, row in enumerate(rows) if row.params.top_p < 1.0 and finite[i]]
    if top_p:
        picked = torch.tensor(top_p)
        ps = [rows[i].params.top_p for i in top_p]
        selected = _select(row_ids, picked, source.shape[0])
        lower[picked] = _top_p_bound(source, selected, shift[picked], scale[picked], lower[picked], ps)
    ratios = [_min_p_log_ratio(row.params) for row in rows]
    if any(r > float("-inf") for r in ratios):
        lower = torch.maximum(lower, shift + torch.tensor(ratios)[:, None])
    return lower


def _kth_largest(source: torch.Tensor, row_ids: torch.Tensor | None, ks: list[int]) -> torch.Tensor:
    """`[m, 1]`: each row's `ks[i]`-th largest logit."""
    values, _ = _best(source, row_ids, max(ks))
    return values.gather(1, torch.tensor(ks)[:, None] - 1)


def _best(source: torch.Tensor, row_ids: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` best logits of the rows `row_ids` of `source` (None: all) and their token ids, best
    first (`[m, k]` each). They lie in the k cells with the best maxima (each of those holds a value
    at least as good as any outside them), so a small k looks in those cells (and the short last one)
    only."""
    (num_source_rows, vocab), num_full = source.shape, source.shape[1] // _CELL
    if 2 * k > num_full:
        return (source if row_ids is None else source.index_select(0, row_ids)).topk(min(k, vocab), dim=-1)
    cells = source[:, : num_full * _CELL].view(num_source_rows, num_full, _CELL)
    rows = torch.arange(num_source_rows) if row_ids is None else row_ids
    best_cells = cells.amax(-1)[rows].topk(k, dim=-1).indices  # [m, k]
    candidates = torch.cat([cells[rows[:, None], best_cells].flatten(1), source[rows, num_full * _CELL :]], dim=1)
    values, positions = candidates.topk(k, dim=-1)
    in_cells = positions < k * _CELL
    cell_ids = best_cells.gather(1, (positions // _CELL).clamp_(max=k - 1)) * _CELL + positions % _CELL
    return values, torch.where(in_cells, cell_ids, positions - k * _CELL + num_full * _CELL)


def _top_p_bound(
    source: torch.Tensor,
    row_ids: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    lower: torch.Tensor,
    top_p: list[float],
) -> torch.Tensor:
    """`[m, 1]`: the lowest logit top-p keeps: the fewest best tokens (at or above `lower`) whose
    probability reaches p, at least the best one, and any tied with the last. No sort of the row:
    a histogram of the mass by exponent finds the bucket where it reaches p, and only that bucket's
    tokens are sorted."""
    num_rows = shift.shape[0]
    bounded = lower if bool((lower > float("-inf")).any()) else None  # top-k came first
    found = vocab_passes.top_p_bound(source, row_ids, shift, scale, bounded, top_p, _FLOOR, _TOP_P_BUCKETS)
    if found is not None:
        return torch.maximum(found, lower)
    boundary, before, target = _top_p_bucket(source, row_ids, shift, scale, bounded, top_p)
    r, values = _bucket_tokens(source, row_ids, shift, scale, bounded, boundary)
    if not len(values):
        return lower
    weights = _weights(values, shift[r, 0], scale[r, 0])
    counts = torch.bincount(r, minlength=num_rows)
    starts = counts.cumsum(0) - counts
    running = weights.cumsum(0)
    running -= torch.where(starts > 0, running[(starts - 1).clamp(min=0)], 0.0)[r]  # within each row
    kept = before[r, 0] + running - weights < target[r, 0]  # the mass before each token is under p
    num_kept = torch.bincount(r, weights=kept.double(), minlength=num_rows).long().clamp_(min=1)
    bound = torch.where(counts > 0, values[(starts + num_kept - 1).clamp_(max=len(values) - 1)], float("-inf"))
    return torch.maximum(bound[:, None], lower)


def _top_p_bucket(
    source: torch.Tensor,
    row_ids: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    lower: torch.Tensor | None,
    top_p: list[float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`[m, 1]` each: the bucket where the mass reaches p (-1 when that is the last one, which holds
    everything down to the floor: then all the row has is kept), the mass before it, and p's mass."""
    mass = torch.zeros(shift.shape[0], _TOP_P_BUCKETS)
    for _, exponents, buckets in _bucketed(source, row_ids, shift, scale, lower):
        mass.scatter_add_(1, buckets, exponents.clamp_(min=_FLOOR).exp2_())
    cumulative = mass.double().cumsum(-1)  # bucket 0 holds the best tokens
    target = torch.tensor(top_p, dtype=torch.float64)[:, None] * cumulative[:, -1:]
    boundary = torch.searchsorted(cumulative, target).clamp_(max=_TOP_P_BUCKETS - 1)
    before = torch.where(boundary > 0, cumulative.gather(1, (boundary - 1).clamp(min=0)), 0.0)
    return boundary.masked_fill_(boundary == _TOP_P_BUCKETS - 1, -1), before, target


def _bucket_tokens(
    source: torch.Tensor,
    row_ids: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    lower: torch.Tensor | None,
    bucket: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens in each row's `bucket` (`[m, 1]`), as their rows and logits, grouped by row and
    best first within one."""
    found_rows, found_columns = [], []
    for first, _, buckets in _bucketed(source, row_ids, shift, scale, lower):
        r, c = (buckets == bucket).nonzero(as_tuple=True)
        found_rows.append(r)
        found_columns.append(c + first)
    r, c = torch.cat(found_rows), torch.cat(found_columns)
    values = _take(source, row_ids, r, c)
    order = values.argsort(descending=True, stable=True)
    order = order[r[order].argsort(stable=True)]
    return r[order], values[order]


def _min_p_log_ratio(params: SamplingParams) -> float:
    """min_p as a bound on `logit - max`: p_i < min_p * p_max <=> logit_i - max < T * log(min_p)."""
    if params.min_p <= 0.0:
        return float("-inf")
    return min(params.temperature, _MAX_TEMPERATURE) * math.log(min(params.min_p, 1.0))


# --- the draw ----------------------------------------------------------------------------------------


def _draw(
    source: torch.Tensor,
    row_ids: torch.Tensor | None,
    row_max: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    lower: torch.Tensor,
    masses: torch.Tensor,
    rows: Sequence[SamplingRow],
    fallback: torch.Tensor,
) -> torch.Tensor:
    """Inverse-CDF draws from the rows `row_ids` of `source` (None: all, in order), at each row's
    temperature (`scale`), keeping its logits at or above `lower`, given its cell masses (all
    `[n, 1]` but those). A row with no finite max or no mass takes `fallback`, its argmax."""
    vocab = source.shape[1]
    masses = masses.double()  # [n, num_cells]
    target = torch.tensor([[_uniform(row)] for row in rows], dtype=torch.float64) * masses.sum(-1, keepdim=True)
    drafts = [row.draft_token_id for row in rows]
    with_drafts = any(d is not None for d in drafts)
    if with_drafts:  # the draft's mass comes first: [0, w_draft) accepts it
        has_draft = torch.tensor([[d is not None] for d in drafts])
        draft_ids = torch.tensor([[0 if d is None else d] for d in drafts])
        assert int(draft_ids.max()) < vocab and int(draft_ids.min()) >= 0, "draft outside the vocabulary"
        draft_values = _take(source, row_ids, torch.arange(len(rows))[:, None], draft_ids)
        draft_weights = _weights(draft_values, shift, scale).masked_fill_(~has_draft | (draft_values < lower), 0.0)
        accepted = target < draft_weights
        target -= draft_weights
        masses.scatter_add_(1, draft_ids // _CELL, -draft_weights).clamp_(min=0.0)  # its cell, without it
    cumulative = masses.cumsum(-1)
    cell = _search(cumulative, target)  # [n, 1]
    mass = masses.gather(1, cell)
    fraction = ((target - cumulative.gather(1, cell) + mass) / mass).clamp_(0.0, 1.0)  # where in the cell
    columns = cell * _CELL + torch.arange(min(_CELL, vocab))  # [n, CELL]; the last cell may be short
    outside = columns >= vocab
    values = _take(source, row_ids, torch.arange(len(rows))[:, None], columns.clamp_(max=vocab - 1))
    exponents = (values - shift).mul_(scale)
    weightless = (exponents <= _FLOOR).logical_or_(outside).logical_or_(values < lower)
    if with_drafts:
        weightless.logical_or_((columns == draft_ids) & has_draft)
    within = exponents.double().exp2_().masked_fill_(weightless, 0.0).cumsum_(-1)  # [n, CELL]
    token_ids = columns.gather(1, _search(within, fraction * within[:, -1:]))
    drawn = row_max.isfinite() & (cumulative[:, -1:] > 0) & (within[:, -1:] > 0)
    if with_drafts:
        token_ids = torch.where(accepted, draft_ids, token_ids)
        drawn |= row_max.isfinite() & accepted
    return torch.where(drawn, token_ids, fallback[:, None])[:, 0]


def _search(cumulative: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`[n, 1]`: the first position whose cumulative weight exceeds the target, or the last
    position with weight when rounding put the target at or past the total."""
    last = torch.searchsorted(cumulative, cumulative[:, -1:].contiguous())  # the first to reach the total
    return torch.searchsorted(cumulative, target, right=True).clamp_(max=last)


def _take(
    source: torch.Tensor, row_ids: torch.Tensor | None, rows: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """`source[row_ids[rows], columns]`, broadcast (`row_ids` None: all rows of `source`, in order)."""
    source_rows = rows if row_ids is None else row_ids[rows]
    return source.view(-1)[source_rows * source.shape[1] + columns]


def _weights(values: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """exp((values - shift) / T) in float64 (`scale` = log2(e) / T), exactly 0 at or below the floor."""
    exponents = (values - shift).mul_(scale)
    return exponents.double().exp2_().masked_fill_(exponents <= _FLOOR, 0.0)


def _uniform(row: SamplingRow) -> float:
    """The row's uniform in [0, 1): a hash of (seed, position), or fresh entropy when unseeded."""
    seed = row.params.seed
    if seed is None:
        return _UNSEEDED.random()
    return (_mix64(_mix64(seed & _MASK64) ^ (row.num_output_tokens & _MASK64)) >> 11) * 2.0**-53


def _mix64(x: int) -> int:
    """splitmix64: a bijection of 64-bit integers whose outputs look independent of their inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


# --- passes over the vocabulary ------------------------------------------------------------------------


def max_argmax_rows(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max (`[rows, 1]`) and `torch.argmax` (`[rows]`) of `[rows, vocab]` logits."""
    found = vocab_passes.max_argmax(logits)
    if found is not None:
        return found
    argmax = argmax_rows(logits)
    return logits.gather(1, argmax[:, None]), argmax


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(logits, -1)` for `[rows, vocab]` (the first index of each row's max), faster on
    the CPU: one sweep of the kernel per row where it runs; else amax, vectorized where argmax is a
    scalar loop, finds each row's best chunk, and argmax runs only inside it."""
    found = vocab_passes.max_argmax(logits)
    if found is not None:
        return found[1]
    num_rows, vocab = logits.shape
    if vocab < 4 * _ARGMAX_CHUNK:
        return logits.argmax(-1)
    num_full = vocab // _ARGMAX_CHUNK
    head = logits[:, : num_full * _ARGMAX_CHUNK].reshape(num_rows, num_full, _ARGMAX_CHUNK)
    maxima = head.amax(-1)  # [rows, num_full]
    if vocab % _ARGMAX_CHUNK:
        maxima = torch.cat([maxima, logits[:, num_full * _ARGMAX_CHUNK :].amax(-1, keepdim=True)], dim=1)
    best_chunk = maxima.argmax(-1, keepdim=True)  # [rows, 1]: the first chunk holding the max
    # The last chunk may be short: clamping repeats its last column after the real ones, and
    # argmax keeps the first occurrence, so the repeats never win over an earlier equal value.
    offsets = torch.arange(_ARGMAX_CHUNK, device=logits.device)
    columns = (best_chunk * _ARGMAX_CHUNK + offsets).clamp_(max=vocab - 1)  # [rows, chunk]
    within = logits.gather(1, columns).argmax(-1, keepdim=True)
    return columns.gather(1, within)[:, 0]


def log_normalizers(logits: torch.Tensor, max_logits: torch.Tensor | None = None) -> torch.Tensor:
    """`logsumexp` of each row (`[rows]`): a token's logprob is its logit minus this.
    `max_logits` (`[rows, 1]`), when the caller knows each row's max, saves a pass."""
    if max_logits is None:
        max_logits = logits.amax(-1, keepdim=True)
    return _normalizers(_cell_masses(logits, _finite(max_logits)), max_logits)


def _normalizers(masses: torch.Tensor, max_logits: torch.Tensor) -> torch.Tensor:
    """From temperature-1 cell masses: sum(exp(logit - max)), so its log plus the max."""
    sums = masses.double().sum(-1).log_().to(masses.dtype)
    normalizers = sums.add_(_finite(max_logits)[:, 0])
    return normalizers.masked_fill_(max_logits[:, 0] == float("-inf"), float("-inf"))  # all masked


def _cell_masses(
    source: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor | None = None,
    row_ids: torch.Tensor | None = None,
    lower: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[rows, num_cells]`: each `_CELL`-column cell's sum of `exp2(max((logit - shift) * scale,
    FLOOR))` over the rows `row_ids` of `source` (None: all), with `shift` finite, `scale`
    log2(e) / temperature (None: temperature 1), logits below `lower` at the floor (all `[rows, 1]`).
    Row-wise reductions only, so a row's masses are the same bits whatever else is in the batch."""
    found = vocab_passes.cell_masses(source, shift, torch.full_like(shift, _LOG2_E) if scale is None else scale,
                                     row_ids, lower, _FLOOR, _CELL)
    if found is not None:
        return found
    num_rows, vocab = source.shape[0] if row_ids is None else len(row_ids), source.shape[1]
    masses = source.new_empty(num_rows, -(-vocab // _CELL))
    # A column chunk at a time through one small scratch: a vocabulary-sized temporary would be
    # handed back to the OS on free and cost thousands of page faults on every step.
    scratch = source.new_empty(num_rows, min(_PASS_COLUMNS, vocab))
    spare = None if lower is None else torch.empty_like(scratch)
    lower = None if lower is None else _finite_bound(lower)
    for first, part in _column_chunks(source, row_ids, _gather_scratch(source, row_ids)):
        width = part.shape[1]
        exponents = torch.sub(part, shift, out=scratch[:, :width]).mul_(_LOG2_E if scale is None else scale)
        if lower is not None:
            _drop_below(exponents, part, lower, spare[:, :width])
        # The floor keeps exp2() out of fp32's denormals, which cost x86 a microcode assist each.
        weights = exponents.clamp_(min=_FLOOR).exp2_()
        cell, num_full = first // _CELL, width // _CELL
        if num_full:
            masses[:, cell : cell + num_full] = weights[:, : num_full * _CELL].view(num_rows, num_full, _CELL).sum(-1)
        if width % _CELL:
            masses[:, cell + num_full] = weights[:, num_full * _CELL :].sum(-1)
    return masses


def _bucketed(
    source: torch.Tensor,
    row_ids: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    lower: torch.Tensor | None,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Per column chunk: its first column, each logit's exponent and its bucket: one of
    `_TOP_P_BUCKETS` equal slices of the exponent from 0 down to the floor, so monotone in the
    logit; logits below `lower` go to the last. Both live in scratch reused by the next chunk."""
    num_rows, width = shift.shape[0], min(_PASS_COLUMNS, source.shape[1])
    exponents, slots = source.new_empty(num_rows, width), source.new_empty(num_rows, width)
    buckets = torch.empty(num_rows, width, dtype=torch.long)
    lower = None if lower is None else _finite_bound(lower)
    for first, part in _column_chunks(source, row_ids, _gather_scratch(source, row_ids)):
        w = part.shape[1]
        exponent = torch.sub(part, shift, out=exponents[:, :w]).mul_(scale)
        if lower is not None:
            _drop_below(exponent, part, lower, slots[:, :w])
        slot = torch.mul(exponent, _TOP_P_BUCKETS / _FLOOR, out=slots[:, :w]).clamp_(0, _TOP_P_BUCKETS - 1)
        yield first, exponent, buckets[:, :w].copy_(slot)  # truncation: the floor of a slot >= 0


def _drop_below(exponents: torch.Tensor, part: torch.Tensor, lower: torch.Tensor, spare: torch.Tensor) -> None:
    """Sends the exponents of the logits below `lower` (`[rows, 1]`, finite) under the floor, by float
    ops alone (a bool mask and masked_fill cost ~30x more on the CPU): sign(logit - lower) is exactly
    -1 there."""
    signs = torch.sub(part, lower, out=spare).sign_()
    torch.minimum(exponents, signs.mul_(-2 * _FLOOR), out=exponents)


def _finite_bound(lower: torch.Tensor) -> torch.Tensor:
    # the lowest float for a -inf bound, so that a -inf logit's sign is -1 rather than NaN's
    return lower.clamp(min=torch.finfo(lower.dtype).min)


def _column_chunks(
    source: torch.Tensor, row_ids: torch.Tensor | None, scratch: torch.Tensor | None
) -> Iterator[tuple[int, torch.Tensor]]:
    """Each `_PASS_COLUMNS`-wide column chunk of the rows `row_ids` of `source` (None: all) with its
    first column: a view, or the rows gathered into `scratch` (reused by the next chunk)."""
    for first in range(0, source.shape[1], _PASS_COLUMNS):
        part = source[:, first : first + _PASS_COLUMNS]
        if row_ids is not None:
            part = torch.index_select(part, 0, row_ids, out=scratch[:, : part.shape[1]])
        yield first, part


def _gather_scratch(source: torch.Tensor, row_ids: torch.Tensor | None) -> torch.Tensor | None:
    return None if row_ids is None else source.new_empty(len(row_ids), min(_PASS_COLUMNS, source.shape[1]))


def _finite(values: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(~values.isfinite(), 0.0)  # as torch.logsumexp: no inf - inf


def _top_logprobs(
    logits: torch.Tensor, normalizers: torch.Tensor, counts: list[int]
) -> list[tuple[tuple[int, float], ...]]:
    """Each row's `counts[i]` best tokens with their raw logprobs, best first (batched)."""
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(counts)
    wanted = [i for i, n in enumerate(counts) if n > 0]
    if not wanted:
        return tops
    index = torch.tensor(wanted)
    values, ids = _best(logits, _unless_all(index, len(counts)), max(counts[i] for i in wanted))
    values = (values - normalizers[index, None]).tolist()
    for r, (i, top_ids) in enumerate(zip(wanted, ids.tolist())):
        tops[i] = tuple(zip(top_ids[: counts[i]], values[r][: counts[i]]))
    return tops
