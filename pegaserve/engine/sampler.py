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
chunked max that finds the argmax, and a chunked exp-sum that gives both the log-normalizer and the
inverse CDF's first level (the mass of each 1024-token cell); the second level looks inside one
cell. A temperature-1 row without processing is drawn from those; a row at another temperature
costs one more exp-sum, and a row with processing a copy of its logits too. Top-p needs the head of
a sorted row, never a full sort. Tokens more than 80 nats below a row's best weigh nothing.
"""

from __future__ import annotations

import array
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from pegaserve.engine.request import SampledToken, SamplingParams

_ARGMAX_CHUNK = 1024
_CELL = 1024  # tokens per cell of the inverse CDF's first level
_PASS_COLUMNS = 16 * _CELL  # columns per exp-sum pass through one small scratch
_LOG2_E = 1.4426950408889634  # exp(x) = exp2(x * log2(e)); torch's CPU exp2 is ~4x faster than exp
_FLOOR = -80.0 * _LOG2_E  # exp() of under -80 is < 2e-35: weightless, and kept out of slow denormals
_TOP_P_CANDIDATES = 1024  # a top-p row's first candidate count, grown 4x until the nucleus fits
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
    plan = _Plan.of(rows, logits.shape[1])
    raw_argmax = argmax_rows(logits)  # [num_rows]
    raw_max = logits.gather(1, raw_argmax[:, None])  # [num_rows, 1]
    raw_masses = _cell_masses(logits, _finite(raw_max))  # [num_rows, num_cells]: temperature 1
    normalizers = _normalizers(raw_masses, raw_max)  # [num_rows]
    token_ids = raw_argmax.clone()  # greedy rows without processing keep theirs
    if plan.unedited:
        token_ids[torch.tensor(plan.unedited)] = _sample_unedited(logits, rows, plan, raw_max, raw_masses, raw_argmax)
    if plan.work:
        index = torch.tensor(plan.work)
        token_ids[index] = _sample_processed(logits.index_select(0, index), [rows[i] for i in plan.work], plan)
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
    """Rows by path. `work` rows are copied and processed, grouped as top-p rows, other filtered
    rows (top-k, min_p), other sampled rows, greedy rows: each phase touches a contiguous slice."""

    unedited: list[int]  # sampled, no processing: drawn from the raw logits, temperature-1 rows first
    num_raw: int  # leading unedited rows at temperature 1, whose cell masses are the raw ones
    work: list[int]
    num_top_p: int
    num_filtered: int  # leading work rows with top-k, top-p or min_p
    num_sampled: int  # leading work rows that are sampled; the rest are greedy

    @staticmethod
    def of(rows: Sequence[SamplingRow], vocab: int) -> _Plan:
        raw, unedited, top_p, filtered, scaled, greedy = [], [], [], [], [], []
        for i, row in enumerate(rows):
            params = row.params
            if params.greedy:
                if row.edited:
                    greedy.append(i)
            elif params.top_p < 1.0:
                top_p.append(i)
            elif 0 < params.top_k < vocab or params.min_p > 0.0:
                filtered.append(i)
            elif row.edited:
                scaled.append(i)
            else:
                (raw if params.temperature == 1.0 else unedited).append(i)
        work = top_p + filtered + scaled + greedy
        num_filtered, num_sampled = len(top_p) + len(filtered), len(work) - len(greedy)
        return _Plan(raw + unedited, len(raw), work, len(top_p), num_filtered, num_sampled)


def _sample_unedited(
    logits: torch.Tensor,
    rows: Sequence[SamplingRow],
    plan: _Plan,
    raw_max: torch.Tensor,
    raw_masses: torch.Tensor,
    raw_argmax: torch.Tensor,
) -> torch.Tensor:
    """Tokens of the sampled rows without processing, drawn from the raw logits; only those not at
    temperature 1 need an exp-sum pass of their own."""
    index = torch.tensor(plan.unedited)
    picked = [rows[i] for i in plan.unedited]
    scale = _scales(picked)
    row_max = raw_max[index]
    masses = raw_masses[index[: plan.num_raw]]
    if plan.num_raw < len(index):
        scaled_ids = _unless_all(index[plan.num_raw :], len(rows))
        scaled = _cell_masses(logits, _finite(row_max[plan.num_raw :]), scale[plan.num_raw :], scaled_ids)
        masses = torch.cat([masses, scaled])
    return _draw(logits, _unless_all(index, len(rows)), row_max, scale, masses, picked, raw_argmax[index])


def _unless_all(row_ids: torch.Tensor, num_rows: int) -> torch.Tensor | None:
    """None when `row_ids` are all `num_rows` rows in order (then no gather is needed)."""
    if len(row_ids) == num_rows and bool((row_ids == torch.arange(num_rows)).all()):
        return None
    return row_ids


def _sample_processed(work: torch.Tensor, rows: list[SamplingRow], plan: _Plan) -> torch.Tensor:
    """Tokens of the rows that need processing; `work` is their own copy of the logits."""
    num_sampled, num_filtered, num_top_p = plan.num_sampled, plan.num_filtered, plan.num_top_p
    _edit(work, rows)
    scale = _scales(rows[:num_sampled])  # temperature is applied inside each exp, never to a copy
    filtered = [row.params for row in rows[:num_filtered]]
    _apply_top_k(work[:num_filtered], [params.top_k for params in filtered])
    _apply_top_p(work[:num_top_p], scale[:num_top_p], [params.top_p for params in filtered[:num_top_p]])
    _apply_min_p(work[:num_filtered], [_min_p_log_ratio(params) for params in filtered])
    argmax = argmax_rows(work)  # greedy rows' tokens; a sampled row's fallback
    if not num_sampled:
        return argmax
    sampled = work[:num_sampled]
    row_max = sampled.gather(1, argmax[:num_sampled, None])
    masses = _cell_masses(sampled, _finite(row_max), scale)
    drawn = _draw(sampled, None, row_max, scale, masses, rows[:num_sampled], argmax[:num_sampled])
    return torch.cat([drawn, argmax[num_sampled:]])


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


def _scales(rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`[n]`: what multiplies `logit - max` inside exp2(): log2(e) / temperature."""
    return torch.tensor([_LOG2_E / min(row.params.temperature, _MAX_TEMPERATURE) for row in rows])


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> None:
    """Keep each row's k best tokens and any tied with the k-th; k <= 0 or >= vocab keeps all."""
    vocab = logits.shape[1]
    k = torch.tensor([t if 0 < t < vocab else 0 for t in top_k], dtype=torch.long)
    if not k.any():
        return
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).clamp_(min=0)[:, None])
    kth.masked_fill_(k[:, None] == 0, float("-inf"))
    logits.masked_fill_(logits < kth, float("-inf"))


def _apply_top_p(logits: torch.Tensor, scale: torch.Tensor, top_p: list[float]) -> None:
    """Keep the fewest best tokens whose probability (at the row's temperature, `scale`) reaches p,
    at least the best one, and any tied with the last of them. It needs the head of a sorted row,
    not a full sort: top-k candidates, more of them until the nucleus fits."""
    if not top_p:
        return
    vocab = logits.shape[1]
    shift = _finite(logits.amax(-1, keepdim=True))
    scale = scale[:, None]
    total = _cell_masses(logits, shift, scale[:, 0]).double().sum(-1, keepdim=True)  # [rows, 1]
    p = torch.tensor(top_p, dtype=torch.float64)[:, None]
    k = min(vocab, _TOP_P_CANDIDATES)
    while True:
        values = logits.topk(k, dim=-1).values  # [rows, k], best first
        probs = _weights(values, shift, scale) / total
        num_kept = ((probs.cumsum(-1) - probs) < p).sum(-1).clamp_(min=1)  # mass before each < p
        weightless = (values[:, -1:] - shift) * scale <= _FLOOR  # so is the rest of the row
        if k == vocab or bool(((num_kept < k) | weightless[:, 0]).all()):
            break
        k = min(vocab, 4 * k)
    threshold = values.gather(1, (num_kept - 1)[:, None])
    logits.masked_fill_(logits < threshold, float("-inf"))


def _min_p_log_ratio(params: SamplingParams) -> float:
    """min_p as a bound on `logit - max`: p_i < min_p * p_max <=> logit_i - max < T * log(min_p)."""
    if params.min_p <= 0.0:
        return float("-inf")
    return min(params.temperature, _MAX_TEMPERATURE) * math.log(min(params.min_p, 1.0))


def _apply_min_p(logits: torch.Tensor, log_ratios: list[float]) -> None:
    """Drop tokens whose `logit - max` is below the row's bound (`-inf`: keep all)."""
    if all(r == float("-inf") for r in log_ratios):
        return
    threshold = logits.amax(-1, keepdim=True) + torch.tensor(log_ratios, dtype=logits.dtype)[:, None]
    logits.masked_fill_(logits < threshold, float("-inf"))


# --- the draw ----------------------------------------------------------------------------------------


def _draw(
    source: torch.Tensor,
    row_ids: torch.Tensor | None,
    row_max: torch.Tensor,
    scale: torch.Tensor,
    masses: torch.Tensor,
    rows: Sequence[SamplingRow],
    fallback: torch.Tensor,
) -> torch.Tensor:
    """Inverse-CDF draws from the rows `row_ids` of `source` (processed logits, contiguous; None:
    all of them) at each row's temperature (`scale`, `[n]`), given its max (`[n, 1]`) and its cell
    masses. A row with no finite max or no mass (everything masked) takes `fallback`, its argmax."""
    vocab = source.shape[1]
    shift, scale = _finite(row_max), scale[:, None]  # [n, 1] each
    masses = masses.double()  # [n, num_cells]
    target = torch.tensor([_uniform(row) for row in rows], dtype=torch.float64)[:, None] * masses.sum(-1, keepdim=True)
    drafts = [row.draft_token_id for row in rows]
    if any(d is not None for d in drafts):  # the draft's mass comes first: [0, w_draft) accepts it
        has_draft = torch.tensor([d is not None for d in drafts])[:, None]
        draft_ids = torch.tensor([0 if d is None else d for d in drafts])[:, None]
        assert int(draft_ids.max()) < vocab and int(draft_ids.min()) >= 0, "draft outside the vocabulary"
        draft_weights = _weights(_take(source, row_ids, draft_ids), shift, scale).masked_fill_(~has_draft, 0.0)
        accepted = target < draft_weights
        target -= draft_weights
        masses.scatter_add_(1, draft_ids // _CELL, -draft_weights).clamp_(min=0.0)  # its cell, without it
    cumulative = masses.cumsum(-1)
    cell = _search(cumulative, target)  # [n, 1]
    mass = masses.gather(1, cell)
    fraction = ((target - cumulative.gather(1, cell) + mass) / mass).clamp_(0.0, 1.0)  # where in the cell
    columns = cell * _CELL + torch.arange(_CELL)  # [n, CELL]; the last cell may be short
    outside = columns >= vocab
    exponents = (_take(source, row_ids, columns.clamp_(max=vocab - 1)) - shift).mul_(scale)
    weightless = (exponents <= _FLOOR).logical_or_(outside)
    if any(d is not None for d in drafts):
        weightless.logical_or_((columns == draft_ids) & has_draft)
    within = exponents.double().exp2_().masked_fill_(weightless, 0.0).cumsum_(-1)  # [n, CELL]
    token_ids = columns.gather(1, _search(within, fraction * within[:, -1:]))
    drawn = row_max.isfinite() & (cumulative[:, -1:] > 0) & (within[:, -1:] > 0)
    if any(d is not None for d in drafts):
        token_ids = torch.where(accepted, draft_ids, token_ids)
        drawn |= row_max.isfinite() & accepted
    return torch.where(drawn, token_ids, fallback[:, None])[:, 0]


def _search(cumulative: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`[n, 1]`: the first position whose cumulative weight exceeds the target, or the last
    position with weight when rounding put the target at or past the total."""
    last = torch.searchsorted(cumulative, cumulative[:, -1:].contiguous())  # the first to reach the total
    return torch.searchsorted(cumulative, target, right=True).clamp_(max=last)


def _take(source: torch.Tensor, row_ids: torch.Tensor | None, columns: torch.Tensor) -> torch.Tensor:
    """`source[row_ids[i], columns[i, j]]`, `[n, m]`."""
    if row_ids is None:
        return source.gather(1, columns)
    return source.take(row_ids[:, None] * source.shape[1] + columns)


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


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """`torch.argmax(logits, -1)` for `[rows, vocab]` (the first index of each row's max), faster on
    the CPU, where argmax is a scalar loop but amax is vectorized: amax finds each row's best chunk,
    argmax runs only inside it."""
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
    logits: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor | None = None, row_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """`[rows, num_cells]`: each `_CELL`-column cell's sum of `exp2(max((logit - shift) * scale,
    FLOOR))` for the rows `row_ids` of `logits` (default: all), `shift` (`[rows, 1]`) finite and
    `scale` (`[rows]`) log2(e) / temperature (default: temperature 1). Row-wise reductions only,
    so a row's masses are the same bits whatever else is in the batch."""
    num_rows = logits.shape[0] if row_ids is None else len(row_ids)
    vocab = logits.shape[1]
    scale = torch.full((num_rows, 1), _LOG2_E) if scale is None else scale[:, None]
    masses = logits.new_empty(num_rows, -(-vocab // _CELL))
    # A column chunk at a time through one small scratch: a vocabulary-sized temporary would be
    # handed back to the OS on free and cost thousands of page faults on every step.
    scratch = logits.new_empty(num_rows, min(_PASS_COLUMNS, vocab))
    for first in range(0, vocab, _PASS_COLUMNS):
        part = logits[:, first : first + _PASS_COLUMNS]
        width = part.shape[1]
        exponents = scratch[:, :width]
        if row_ids is None:
            torch.sub(part, shift, out=exponents)
        else:
            torch.index_select(part, 0, row_ids, out=exponents).sub_(shift)
        # The floor keeps exp2() out of fp32's denormals, which cost x86 a microcode assist each.
        weights = exponents.mul_(scale).clamp_(min=_FLOOR).exp2_()
        cell, num_full = first // _CELL, width // _CELL
        if num_full:
            masses[:, cell : cell + num_full] = weights[:, : num_full * _CELL].view(num_rows, num_full, _CELL).sum(-1)
        if width % _CELL:
            masses[:, cell + num_full] = weights[:, num_full * _CELL :].sum(-1)
    return masses


def _finite(values: torch.Tensor) -> torch.Tensor:
    return values.masked_fill(~values.isfinite(), 0.0)  # as torch.logsumexp: no inf - inf


def _top_logprobs(
    logits: torch.Tensor, normalizers: torch.Tensor, counts: list[int]
) -> list[tuple[tuple[int, float], ...]]:
    """Each row's `counts[i]` best tokens with their raw logprobs, best first (one batched topk)."""
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(counts)
    wanted = [i for i, n in enumerate(counts) if n > 0]
    if not wanted:
        return tops
    index = torch.tensor(wanted)
    part = logits if len(wanted) == len(counts) else logits.index_select(0, index)
    values, ids = part.topk(min(max(counts[i] for i in wanted), logits.shape[1]), dim=-1)
    values = (values - normalizers[index, None]).tolist()
    for r, (i, top_ids) in enumerate(zip(wanted, ids.tolist())):
        tops[i] = tuple(zip(top_ids[: counts[i]], values[r][: counts[i]]))
    return tops
