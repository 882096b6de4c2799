"""Sampling: small pure functions over a step's logits, one row per request.

Logprobs are the log-softmax of the model's raw logits (before masking, temperature, top-k/p), as
vLLM reports them by default. A seeded request draws from a generator seeded by (seed, position),
so its tokens do not depend on what else is in the batch, on preemption, or on which replica —
prefill or decode — samples it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pegaserve.engine.request import SampledToken, SamplingParams

_SEED_STRIDE = 1_000_003  # decorrelates (seed, position) pairs


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    num_output_tokens: int  # tokens this request already has; the sampled one is the next
    masked_token_ids: frozenset[int]  # min_tokens masking (CONTRACT.md rule 6)


def apply_mask(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    masked = [(i, row.masked_token_ids) for i, row in enumerate(rows) if row.masked_token_ids]
    if not masked:
        return logits
    logits = logits.clone()
    for i, token_ids in masked:
        logits[i, torch.tensor(sorted(token_ids), dtype=torch.long)] = float("-inf")
    return logits


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
    logprobs = torch.log_softmax(logits, dim=-1)
    masked = apply_mask(logits, rows)
    greedy_ids = torch.argmax(masked, dim=-1).tolist()
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        if row.params.greedy:
            token_ids.append(greedy_ids[i])
            continue
        filtered = top_k_top_p(masked[i] / row.params.temperature, row.params.top_k, row.params.top_p)
        token_ids.append(_draw(filtered.softmax(-1), _generator(row.params, row.num_output_tokens)))
    chosen = logprobs.gather(1, torch.tensor(token_ids)[:, None])[:, 0].tolist()
    return [
        SampledToken(token_id, chosen[i], _top_logprobs(logprobs[i], rows[i].params.num_top_logprobs))
        for i, token_id in enumerate(token_ids)
    ]


def _top_logprobs(logprobs: torch.Tensor, n: int) -> tuple[tuple[int, float], ...]:
    if n <= 0:
        return ()
    values, ids = torch.topk(logprobs, n)
    return tuple(zip(ids.tolist(), values.tolist()))
