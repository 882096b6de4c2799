"""The sampler's temperature scales and filters. A filter never writes: each gives a row's lowest kept
logit (-inf: keeps all), top-k's from the k cells with the best maxima, top-p's (over what top-k keeps) from
a histogram of the mass and a sort of one bucket of it (never of a row), min_p's in closed form.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pegaserve.cpu import vocab_passes
from pegaserve.messages import SamplingParams
from pegaserve.sample.passes import (
    CELL,
    FLOOR,
    LOG2_E,
    TOP_P_BUCKETS,
    bucketed_exponents,
    exp_weights,
    select_rows,
    take_values,
)
from pegaserve.sample.processing import SamplingRow

_MAX_TEMPERATURE = 1e30  # keeps logits / temperature finite, and -inf at -inf


def temperature_scales(rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`[n, 1]`: what multiplies `logit - max` inside exp2(): log2(e) / temperature."""
    return torch.tensor([[temperature_scale(row.params)] for row in rows])


def temperature_scale(params: SamplingParams) -> float:
    """One row's `temperature_scales`."""
    return LOG2_E / min(params.temperature, _MAX_TEMPERATURE)


def has_filters(params: SamplingParams, vocab: int) -> bool:
    """Whether top-k, top-p or min_p may drop tokens of a `vocab`-token row."""
    return params.top_p < 1.0 or 0 < params.top_k < vocab or params.min_p > 0.0


def lower_bounds(
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
        lower[picked] = _kth_largest(source, select_rows(row_ids, picked, source.shape[0]), ks)
    finite = row_max[:, 0].isfinite().tolist()  # a row without a finite max falls back to its argmax
    top_p = [i for i, row in enumerate(rows) if row.params.top_p < 1.0 and finite[i]]
    if top_p:
        picked = torch.tensor(top_p)
        ps = [rows[i].params.top_p for i in top_p]
        selected = select_rows(row_ids, picked, source.shape[0])
        lower[picked] = top_p_bound(source, selected, shift[picked], scale[picked], lower[picked], ps)
    ratios = [_min_p_log_ratio(row.params) for row in rows]
    if any(r > float("-inf") for r in ratios):
        lower = torch.maximum(lower, shift + torch.tensor(ratios)[:, None])
    return lower


def _kth_largest(source: torch.Tensor, row_ids: torch.Tensor | None, ks: list[int]) -> torch.Tensor:
    """`[m, 1]`: each row's `ks[i]`-th largest logit."""
    values, _ = top_logits(source, row_ids, max(ks))
    return values.gather(1, torch.tensor(ks)[:, None] - 1)


def top_logits(source: torch.Tensor, row_ids: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` best logits of the rows `row_ids` of `source` (None: all) and their token ids, best
    first (`[m, k]` each). They lie in the k cells with the best maxima (each of those holds a value
    at least as good as any outside them), so a small k looks in those cells (and the short last one)
    only."""
    (num_source_rows, vocab), num_full = source.shape, source.shape[1] // CELL
    if 2 * k > num_full:
        return (source if row_ids is None else source.index_select(0, row_ids)).topk(min(k, vocab), dim=-1)
    cells = source[:, : num_full * CELL].view(num_source_rows, num_full, CELL)
    rows = torch.arange(num_source_rows) if row_ids is None else row_ids
    best_cells = cells.amax(-1)[rows].topk(k, dim=-1).indices  # [m, k]
    candidates = torch.cat([cells[rows[:, None], best_cells].flatten(1), source[rows, num_full * CELL :]], dim=1)
    values, positions = candidates.topk(k, dim=-1)
    in_cells = positions < k * CELL
    cell_ids = best_cells.gather(1, (positions // CELL).clamp_(max=k - 1)) * CELL + positions % CELL
    return values, torch.where(in_cells, cell_ids, positions - k * CELL + num_full * CELL)


def top_p_bound(
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
    found = vocab_passes.top_p_bound(source, row_ids, shift, scale, bounded, top_p, FLOOR, TOP_P_BUCKETS)
    if found is not None:
        return torch.maximum(found, lower)
    boundary, before, target = _top_p_bucket(source, row_ids, shift, scale, bounded, top_p)
    r, values = _bucket_tokens(source, row_ids, shift, scale, bounded, boundary)
    if not len(values):
        return lower
    weights = exp_weights(values, shift[r, 0], scale[r, 0])
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
    mass = torch.zeros(shift.shape[0], TOP_P_BUCKETS)
    for _, exponents, buckets in bucketed_exponents(source, row_ids, shift, scale, lower):
        mass.scatter_add_(1, buckets, exponents.clamp_(min=FLOOR).exp2_())
    cumulative = mass.double().cumsum(-1)  # bucket 0 holds the best tokens
    target = torch.tensor(top_p, dtype=torch.float64)[:, None] * cumulative[:, -1:]
    boundary = torch.searchsorted(cumulative, target).clamp_(max=TOP_P_BUCKETS - 1)
    before = torch.where(boundary > 0, cumulative.gather(1, (boundary - 1).clamp(min=0)), 0.0)
    return boundary.masked_fill_(boundary == TOP_P_BUCKETS - 1, -1), before, target


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
    for first, _, buckets in bucketed_exponents(source, row_ids, shift, scale, lower):
        r, c = (buckets == bucket).nonzero(as_tuple=True)
        found_rows.append(r)
        found_columns.append(c + first)
    r, c = torch.cat(found_rows), torch.cat(found_columns)
    values = take_values(source, row_ids, r, c)
    order = values.argsort(descending=True, stable=True)
    order = order[r[order].argsort(stable=True)]
    return r[order], values[order]


def _min_p_log_ratio(params: SamplingParams) -> float:
    """min_p as a bound on `logit - max`: p_i < min_p * p_max <=> logit_i - max < T * log(min_p)."""
    if params.min_p <= 0.0:
        return float("-inf")
    return min(params.temperature, _MAX_TEMPERATURE) * math.log(min(params.min_p, 1.0))
