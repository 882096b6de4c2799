"""Sampling: small pure functions over a step's logits, one row per request.

Logprobs are the log-softmax of the model's raw logits (before masking, temperature, top-k/p), as
vLLM reports them by default. A seeded request draws from a generator seeded by (seed, position),
so its tokens do not depend on what else is in the batch, on preemption, or on which replica —
prefill or decode — samples it.

A vocabulary is ~150k wide, so passes over it dominate a small model's step: each runs once per
step over all rows — a chunked max that finds the argmax, and a chunked exp-sum for the
log-normalizer. A full log-softmax is never materialized; top-N logprobs are the top-N logits minus
the normalizer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pegaserve.engine.request import SampledToken, SamplingParams

_SEED_STRIDE = 1_000_003  # decorrelates (seed, position) pairs
_ARGMAX_CHUNK = 1024
_NORMALIZER_CHUNK = 16384


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    num_output_tokens: int  # tokens this request already has; the sampled one is the next
    masked_token_ids: frozenset[int]  # min_tokens masking (docs/CONTRACT.md rule 6)


def apply_mask(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    masked = [(i, row.masked_token_ids) for i, row in enumerate(rows) if row.masked_token_ids]
    if not masked:
        return logits
    logits = logits.clone()
    for i, token_ids in masked:
        logits[i, torch.tensor(sorted(token_ids), dtype=torch.long)] = float("-inf")
    return logits


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
    num_rows, vocab = logits.shape
    if max_logits is None:
        max_logits = logits.amax(-1, keepdim=True)
    finite_max = max_logits.masked_fill(max_logits.isinf(), 0.0)  # as torch.logsumexp: no inf - inf
    # A column chunk at a time through one small scratch: a vocabulary-sized temporary would be
    # handed back to the OS on free and cost thousands of page faults on every step.
    sums = torch.zeros(num_rows, dtype=logits.dtype, device=logits.device)
    scratch = torch.empty(num_rows, min(_NORMALIZER_CHUNK, vocab), dtype=logits.dtype, device=logits.device)
    for first in range(0, vocab, _NORMALIZER_CHUNK):
        part = logits[:, first : first + _NORMALIZER_CHUNK]
        shifted = torch.sub(part, finite_max, out=scratch[:, : part.shape[1]])
        # exp() of anything below -80 is under 2e-35, lost next to the max's exp(0) = 1 in the
        # sum; clamping keeps it out of fp32's denormals, which cost x86 a microcode assist each.
        sums += shifted.clamp_(min=-80.0).exp_().sum(-1)
    normalizers = sums.log_().add_(finite_max[:, 0])
    return normalizers.masked_fill_(max_logits[:, 0] == float("-inf"), float("-inf"))  # all masked


def top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Keep the top-k tokens, then the smallest set whose probability reaches top_p (one row)."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        cumulative_before = probs.cumsum(-1) - probs
        drop = cumulative_before >= top_p  # the first token is always kept
        logits = logits.clone()
        logits[order[drop]] = float("-inf")
    return logits


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    # The exponential race equals multinomial sampling and needs one draw per vocabulary entry,
    # whatever the distribution, so a seed maps to one stream of noise.
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / noise))


def _generator(params: SamplingParams, position: int) -> torch.Generator | None:
    if params.seed is None:
        return None
    return torch.Generator().manual_seed((params.seed * _SEED_STRIDE + position) % (2**63))


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    """One token per row of `logits` ([num_rows, vocab], float32)."""
    masked = apply_mask(logits, rows)
    argmax_ids = argmax_rows(masked)  # [num_rows]
    token_ids = argmax_ids.tolist()  # the greedy rows' tokens; the others are drawn below
    for i, row in enumerate(rows):
        if not row.params.greedy:
            filtered = top_k_top_p(masked[i] / row.params.temperature, row.params.top_k, row.params.top_p)
            token_ids[i] = _draw(filtered.softmax(-1), _generator(row.params, row.num_output_tokens))
    max_logits = logits.gather(1, argmax_ids[:, None]) if masked is logits else None  # unmasked: the max
    normalizers = log_normalizers(logits, max_logits)  # [num_rows]
    chosen = (logits.gather(1, torch.tensor(token_ids)[:, None])[:, 0] - normalizers).tolist()
    return [
        SampledToken(token_id, chosen[i], _top_logprobs(logits[i], normalizers[i], rows[i].params.num_top_logprobs))
        for i, token_id in enumerate(token_ids)
    ]


def _top_logprobs(logits: torch.Tensor, normalizer: torch.Tensor, n: int) -> tuple[tuple[int, float], ...]:
    if n <= 0:
        return ()
    values, ids = torch.topk(logits, n)
    return tuple(zip(ids.tolist(), (values - normalizer).tolist()))
