"""Sampling and prompt scoring where the logits are, for an engine on an accelerator.

`sample()` runs on the CPU: its passes over the vocabulary are written for it. On a GPU, moving a
step's logits there costs more than the step's model: at batch 64 over a 152k vocabulary, 39 MB a
step, 28 ms on an H200 host plus 14 ms of the CPU's passes, against ~40 ms for the model
(docs/bench/GPU.md). So the plain rows, greedy or drawn at a temperature alone (what most clients
send), are taken on the device and only their tokens and logprobs cross; the rows with processing
(logit_bias, penalties, masks: allowed_token_ids, a grammar, min_tokens) or a top-k, top-p or
min_p filter cross alone, through `sample()`.

A plain row is what `sample()` would make of it: the argmax (the first best) when greedy, else an
inverse-CDF draw at its temperature with the row's hashed uniform (draw.uniform: a seeded
row's token depends on nothing else in the batch), tokens more than 80 nats below the best weighing
nothing; logprobs are the raw log-softmax. The draw reads one float64 cumulative sum of the row's
weights where `sample()` reads float32 cell masses first, so a seed picks the same token on both but
where its uniform falls within rounding of a boundary between two tokens (around one draw in 10^5):
seeds reproduce on one kind of device, not always across CPU and GPU.

Prompt scoring (prompt logprobs, echo: what an eval harness's loglikelihood requests are) crossed
64 rows of logits per chunk the same way; on a device it reduces there too (`score_on_device`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pegaserve.messages import SampledToken, TokenScore
from pegaserve.sample.draw import search_cumulative, uniform
from pegaserve.sample.filters import has_filters, temperature_scale
from pegaserve.sample.passes import exp_weights, finite_or_zero
from pegaserve.sample.processing import SamplingRow
from pegaserve.sample.sampler import alternatives, sample, score_tokens


def sample_on_device(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """`sample(logits, rows)` for logits on any device ([num_rows, vocab], float32, never modified)."""
    return sample(logits, rows) if logits.device.type == "cpu" else sample_split(logits, rows)


def score_on_device(logits: torch.Tensor, target_ids: Sequence[int], num_top: int) -> list[TokenScore]:
    """`score_tokens(logits, target_ids, num_top)` for logits on any device."""
    if logits.device.type == "cpu":
        return score_tokens(logits, target_ids, num_top)
    return score_torch(logits, target_ids, num_top)


def score_torch(logits: torch.Tensor, target_ids: Sequence[int], num_top: int) -> list[TokenScore]:
    """Row i of `logits` scores `target_ids[i]` as `score_tokens` does, in torch ops where `logits` are."""
    targets = torch.tensor(target_ids, dtype=torch.long, device=logits.device)[:, None]
    normalizers = torch.logsumexp(logits, -1)  # [n]
    target_logits = logits.gather(1, targets)  # [n, 1]
    ranks = (logits > target_logits).sum(-1).add_(1)  # 1 + the tokens strictly better
    # one transfer for both: ranks are exact in float64
    pairs = torch.stack(((target_logits[:, 0] - normalizers).double(), ranks.double()), 1).tolist()
    tops = _top_logprobs(logits, normalizers, [num_top] * len(target_ids))
    return [TokenScore(t, lp, int(rank), top) for t, (lp, rank), top in zip(target_ids, pairs, tops)]


def sample_split(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    """The plain rows sampled where `logits` are, the others by `sample()` on a CPU copy of theirs."""
    is_plain = [_plain(row, logits.shape[1]) for row in rows]
    plain = [i for i, p in enumerate(is_plain) if p]
    rest = [i for i, p in enumerate(is_plain) if not p]
    tokens: list[SampledToken | None] = [None] * len(rows)
    if rest:
        on_cpu = _rows(logits, rest).cpu()
        for i, token in zip(rest, sample(on_cpu, [rows[i] for i in rest])):
            tokens[i] = token
    if plain:
        for i, token in zip(plain, _sample_plain(_rows(logits, plain), [rows[i] for i in plain])):
            tokens[i] = token
    return tokens  # type: ignore[return-value]  # every row was filled by one of the two


def _plain(row: SamplingRow, vocab: int) -> bool:
    params = row.params
    if row.edited:
        return False
    return params.greedy or not has_filters(params, vocab)


def _rows(logits: torch.Tensor, picked: list[int]) -> torch.Tensor:
    if len(picked) == logits.shape[0]:
        return logits
    return logits.index_select(0, torch.tensor(picked, device=logits.device))


def _sample_plain(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampledToken]:
    token_ids = logits.argmax(-1)  # [n]: the first best
    if not all(row.params.greedy for row in rows):
        token_ids = _draw(logits, token_ids, rows)
    normalizers = torch.logsumexp(logits, -1)  # [n]
    chosen = logits.gather(1, token_ids[:, None])[:, 0] - normalizers
    # one transfer for both: token ids are exact in float64
    pairs = torch.stack((token_ids.double(), chosen.double()), 1).tolist()
    tops = alternatives(logits, normalizers, rows, _top_logprobs)
    return [SampledToken(int(t), lp if row.wants_logprob else None, top)
            for (t, lp), top, row in zip(pairs, tops, rows)]


def _draw(source: torch.Tensor, argmax: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Each sampled row's inverse-CDF draw at its temperature; a greedy row, or one with no finite
    max or no mass, keeps its argmax. Every row is weighed, so no row is gathered."""
    per_row = torch.tensor(
        [(1.0, 0.0, 0.0) if row.params.greedy else (temperature_scale(row.params), uniform(row), 1.0) for row in rows],
        dtype=torch.float64,
    )
    # One copy for the whole step, from pinned memory: one from pageable memory would first wait for
    # the step's model to finish on the device, with the host idle.
    if source.is_cuda:
        per_row = per_row.pin_memory()
    per_row = per_row.to(source.device, non_blocking=True)  # [n, 3]: scale, uniform, sampled
    row_max = source.gather(1, argmax[:, None])  # [n, 1]
    cumulative = exp_weights(source, finite_or_zero(row_max), per_row[:, :1].float()).cumsum_(-1)  # [n, vocab], float64
    token_ids = search_cumulative(cumulative, per_row[:, 1:2] * cumulative[:, -1:])[:, 0]
    drawn = (per_row[:, 2] > 0) & row_max[:, 0].isfinite() & (cumulative[:, -1] > 0)
    return torch.where(drawn, token_ids, argmax)


def _top_logprobs(logits: torch.Tensor, normalizers: torch.Tensor, counts: list[int]):
    """Each row's `counts[i]` best tokens with their raw logprobs, best first."""
    tops: list[tuple[tuple[int, float], ...]] = [()] * len(counts)
    if not any(counts):
        return tops
    values, ids = logits.topk(max(counts), -1)
    values = (values - normalizers[:, None]).tolist()
    for i, (n, top_ids) in enumerate(zip(counts, ids.tolist())):
        tops[i] = tuple(zip(top_ids[:n], values[i][:n]))
    return tops
