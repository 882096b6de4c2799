"""The sampler's passes over the vocabulary, and the row helpers that its filters and its draw share.

Each pass runs the kernel (pegaserve/cpu/vocab_passes.py) where it can, else torch ops that compute the same
quantities, the wide ones a column chunk at a time through one small scratch. Rows are `row_ids` of `source`
(None: all of them, in order); per-row arguments are `[n, 1]`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from pegaserve.cpu import vocab_passes

_ARGMAX_CHUNK = 1024
CELL = 1024  # tokens per cell of the inverse CDF's first level
_PASS_COLUMNS = 16 * CELL  # columns per exp-sum pass through one small scratch
LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); torch's CPU exp2 is ~4x faster than exp
FLOOR = -80.0 * LOG2_E  # exp() of under -80 is < 2e-35: weightless, and kept out of slow denormals
TOP_P_BUCKETS = 4096  # histogram slices of the exponent range; top-p sorts one slice's tokens


def max_argmax_rows(logits: torch.Tensor, row_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max (`[rows, 1]`) and `torch.argmax` (`[rows]`) of `[rows, vocab]` logits (the
    rows `row_ids`; None: all)."""
    found = vocab_passes.max_argmax(logits, row_ids)
    if found is not None:
        return found
    if row_ids is not None:
        logits = logits.index_select(0, row_ids)
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
    return normalizers_from_masses(cell_masses(logits, finite_or_zero(max_logits)), max_logits)


def normalizers_from_masses(masses: torch.Tensor, max_logits: torch.Tensor) -> torch.Tensor:
    """From temperature-1 cell masses: sum(exp(logit - max)), so its log plus the max."""
    sums = masses.double().sum(-1).log_().to(masses.dtype)
    normalizers = sums.add_(finite_or_zero(max_logits)[:, 0])
    return normalizers.masked_fill_(max_logits[:, 0] == float("-inf"), float("-inf"))  # all masked


def cell_masses(
    source: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor | None = None,
    row_ids: torch.Tensor | None = None,
    lower: torch.Tensor | None = None,
) -> torch.Tensor:
    """`[rows, num_cells]`: each `CELL`-column cell's sum of `exp2(max((logit - shift) * scale,
    FLOOR))` over the rows `row_ids` of `source` (None: all), with `shift` finite, `scale`
    log2(e) / temperature (None: temperature 1), logits below `lower` at the floor (all `[rows, 1]`).
    Row-wise reductions only, so a row's masses are the same bits whatever else is in the batch."""
    found = vocab_passes.cell_masses(
        source, shift, torch.full_like(shift, LOG2_E) if scale is None else scale, row_ids, lower, FLOOR, CELL
    )
    if found is not None:
        return found
    num_rows, vocab = source.shape[0] if row_ids is None else len(row_ids), source.shape[1]
    masses = source.new_empty(num_rows, -(-vocab // CELL))
    # A column chunk at a time through one small scratch: a vocabulary-sized temporary would be
    # handed back to the OS on free and cost thousands of page faults on every step.
    scratch = source.new_empty(num_rows, min(_PASS_COLUMNS, vocab))
    spare = None if lower is None else torch.empty_like(scratch)
    lower = None if lower is None else _finite_bound(lower)
    for first, part in _column_chunks(source, row_ids, _gather_scratch(source, row_ids)):
        width = part.shape[1]
        exponents = torch.sub(part, shift, out=scratch[:, :width]).mul_(LOG2_E if scale is None else scale)
        if lower is not None:
            _drop_below(exponents, part, lower, spare[:, :width])
        # The floor keeps exp2() out of fp32's denormals, which cost x86 a microcode assist each.
        weights = exponents.clamp_(min=FLOOR).exp2_()
        cell, num_full = first // CELL, width // CELL
        if num_full:
            masses[:, cell : cell + num_full] = weights[:, : num_full * CELL].view(num_rows, num_full, CELL).sum(-1)
        if width % CELL:
            masses[:, cell + num_full] = weights[:, num_full * CELL :].sum(-1)
    return masses


def bucketed_exponents(
    source: torch.Tensor,
    row_ids: torch.Tensor | None,
    shift: torch.Tensor,
    scale: torch.Tensor,
    lower: torch.Tensor | None,
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """Per column chunk: its first column, each logit's exponent and its bucket: one of
    `TOP_P_BUCKETS` equal slices of the exponent from 0 down to the floor, so monotone in the
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
        slot = torch.mul(exponent, TOP_P_BUCKETS / FLOOR, out=slots[:, :w]).clamp_(0, TOP_P_BUCKETS - 1)
        yield first, exponent, buckets[:, :w].copy_(slot)  # truncation: the floor of a slot >= 0


def _drop_below(exponents: torch.Tensor, part: torch.Tensor, lower: torch.Tensor, spare: torch.Tensor) -> None:
    """Sends the exponents of the logits below `lower` (`[rows, 1]`, finite) under the floor, by float
    ops alone (a bool mask and masked_fill cost ~30x more on the CPU): sign(logit - lower) is exactly
    -1 there."""
    signs = torch.sub(part, lower, out=spare).sign_()
    torch.minimum(exponents, signs.mul_(-2 * FLOOR), out=exponents)


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


def finite_or_zero(values: torch.Tensor) -> torch.Tensor:
    """`values` with each infinite or NaN one at 0: a shift that never makes inf - inf."""
    return values.masked_fill(~values.isfinite(), 0.0)  # as torch.logsumexp: no inf - inf


# --- rows of a source, and their weights ---------------------------------------------------------------


def select_rows(row_ids: torch.Tensor | None, picked: torch.Tensor, num_source_rows: int) -> torch.Tensor | None:
    """The source rows of the `picked` ones among `row_ids` (None: all rows of the source, in order)."""
    return unless_all(picked if row_ids is None else row_ids[picked], num_source_rows)


def unless_all(row_ids: torch.Tensor, num_rows: int) -> torch.Tensor | None:
    """None when `row_ids` are all `num_rows` rows in order (then no gather is needed)."""
    if len(row_ids) == num_rows and bool((row_ids == torch.arange(num_rows)).all()):
        return None
    return row_ids


def take_values(
    source: torch.Tensor, row_ids: torch.Tensor | None, rows: torch.Tensor, columns: torch.Tensor
) -> torch.Tensor:
    """`source[row_ids[rows], columns]`, broadcast (`row_ids` None: all rows of `source`, in order)."""
    source_rows = rows if row_ids is None else row_ids[rows]
    return source.view(-1)[source_rows * source.shape[1] + columns]


def exp_weights(values: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """exp((values - shift) / T) in float64 (`scale` = log2(e) / T), exactly 0 at or below the floor."""
    exponents = (values - shift).mul_(scale)
    return exponents.double().exp2_().masked_fill_(exponents <= FLOOR, 0.0)
