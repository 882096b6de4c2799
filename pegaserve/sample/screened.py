"""A step's tokens from its hidden states, through the screened LM head (`lm_head.ScreenedHead`, an
fp16 copy of the weight: half the bytes) where its rows allow it, each with the law it has from the
full logits:

- A row that wants the raw argmax alone (`sampler.argmax_only`) takes the screened argmax: the full
  logits' own, bit for bit.
- A sampled row without filter or logprob (`draws_by_rejection`) is drawn by rejection from
  upper bounds U_j >= L_j of its fp32 logits L. Its processing (logit_bias, penalties, the allowed_token_ids
  and min_tokens masks: processing.py) maps each logit alone, by float32 ops that never turn a larger
  logit into a smaller one, so processed bounds bound processed logits: below, U and L stand for
  both processed (the bounds by `edit_rows`, the one exact logit by `edit_at`, the same ops on the same
  float as the full logits' path). The sampler's own draw (`draw_tokens`, its cells and floor) proposes
  j with weight 2^((U_j - max U) * scale); j is accepted with probability 2^((L_j - U_j) * scale)
  <= 1, its one fp32 logit computed for that; else the row proposes again with its next uniforms
  (`uniform`'s streams). An accepted token has weight 2^((L_j - max U) * scale) whatever the
  proposals before it: the law of the draw from the full logits. On the default
  model U_j - L_j is ~0.07 nats where the mass is (|x| times the bounds' mean predicts it), so ~93%
  of proposals at temperature 1 are accepted; a row whose typical slack at its temperature is over
  MAX_SLACK (the default model: temperatures under ~0.14; a repetition_penalty r stretches the
  slack by up to max(r, 1/r)) takes its full logits instead of many proposals. A row still rejected
  after MAX_PROPOSALS, or whose bounds are not finite, is drawn from its full logits with the
  uniforms after those its proposals read: a fresh draw, so the law holds whatever its proposals
  were. As the sampler's, a seeded row's token depends on its hidden state, seed and position
  alone.
- Every other row is sampled from the full logits (`sample_on_device`). A step with such a row
  gives its greedy rows the full logits too (their weight stream is paid then), never the rows
  drawn by rejection, whose draw must not depend on the batch.

Without a screened head (no kernel, a GPU, an fp16 overflow) every row takes the full logits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import torch

from pegaserve.cpu.lm_head import ScreenedHead
from pegaserve.messages import SampledToken
from pegaserve.sample.draw import draw_tokens, uniform
from pegaserve.sample.filters import has_filters, temperature_scales
from pegaserve.sample.on_device import sample_on_device
from pegaserve.sample.passes import CELL, FLOOR, cell_masses, finite_or_zero, max_argmax_rows
from pegaserve.sample.processing import SamplingRow, edit_at, edit_rows
from pegaserve.sample.sampler import argmax_only

MAX_PROPOSALS = 16  # at MAX_SLACK a proposal is accepted with probability ~exp(-MAX_SLACK)
MAX_SLACK = 0.5  # nats: |x| * mean bound / temperature, above which a row takes its full logits


def draws_by_rejection(row: SamplingRow, vocab: int) -> bool:
    """Whether the row is drawn from the screened head's upper bounds: sampled, with no filter or
    logprob (processing is applied to the bounds)."""
    params = row.params
    return not row.wants_logprob and not params.greedy and not has_filters(params, vocab)


def _stretch(row: SamplingRow) -> float:
    """How much the row's processing can widen a bound's slack: a repetition penalty r scales a
    logit by 1/r or r; the rest only shift one."""
    penalty = row.params.repetition_penalty
    return max(penalty, 1 / penalty) if penalty > 0 else math.inf


def sample_hidden(
    hidden: torch.Tensor,
    row_of: Sequence[int],
    rows: Sequence[SamplingRow],
    head: ScreenedHead | None,
    full_logits: Callable[[torch.Tensor], torch.Tensor],
) -> list[SampledToken]:
    """One token per row of `rows`, row i's from `hidden[row_of[i]]` (`[num_positions, hidden]`),
    where several rows may share a position; `full_logits` turns hidden rows into fp32 logits."""
    tokens: list[SampledToken | None] = [None] * len(rows)
    rest = list(range(len(rows)))
    rows = list(rows)
    if head is not None:
        drawn = [i for i in rest if draws_by_rejection(rows[i], head.logits.vocab_size)]
        if drawn:
            picked, index = _positions(hidden, row_of, drawn)
            stretch = torch.tensor([_stretch(rows[i]) for i in drawn])
            slack = picked.detach().float().norm(dim=1).cpu()[index] * head.mean_bound * stretch
            scale = temperature_scales([rows[i] for i in drawn])[:, 0]
            close = slack * scale <= MAX_SLACK * math.log2(math.e)  # in log2 units
            drawn, index = [i for i, ok in zip(drawn, close.tolist()) if ok], index[close]
        if drawn:
            found = _draw_by_rejection(head, picked[index], [rows[i] for i in drawn])
            for i, token_id in zip(drawn, found):
                if token_id >= 0:
                    tokens[i] = SampledToken(token_id, None)
                else:  # its full logits draw it, from uniforms its proposals did not read
                    rows[i] = dataclasses.replace(rows[i], stream=rows[i].stream + 2 * MAX_PROPOSALS)
        rest = [i for i in rest if tokens[i] is None]
        if rest and all(argmax_only(rows[i]) for i in rest):
            picked, index = _positions(hidden, row_of, rest)
            argmax = head.argmax(picked)[index].tolist()
            for i, token_id in zip(rest, argmax):
                tokens[i] = SampledToken(token_id, None)
            rest = []
    if rest:
        picked, index = _positions(hidden, row_of, rest)
        logits = full_logits(picked)
        if len(picked) != len(rest):
            logits = logits[index.to(logits.device)]
        for i, token in zip(rest, sample_on_device(logits, [rows[i] for i in rest])):
            tokens[i] = token
    return tokens  # type: ignore[return-value]  # every row has its token


def _positions(hidden: torch.Tensor, row_of: Sequence[int], subset: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The hidden rows of the `subset` of rows, each position once, and each row's index among them."""
    positions = sorted({row_of[i] for i in subset})
    where = {position: k for k, position in enumerate(positions)}
    picked = hidden.index_select(0, torch.tensor(positions, device=hidden.device))
    return picked, torch.tensor([where[row_of[i]] for i in subset])


def _draw_by_rejection(head: ScreenedHead, hidden: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
    """Row i's token drawn by rejection from `head`'s upper bounds of `hidden[i]`'s logits (the
    module docstring), or -1 where its full logits must draw it."""
    scale = temperature_scales(rows)  # [n, 1]
    upper, row_max, masses = head.upper_logits(hidden, scale[:, 0], FLOOR, CELL)  # [n, vocab], [n, 1], [n, cells]
    edited = [i for i, row in enumerate(rows) if row.edited]
    if edited:  # their bounds processed, and their maxima and masses found anew
        edit_rows(upper, list(rows))
        index = torch.tensor(edited)
        row_max[index] = max_argmax_rows(upper, index)[0]
        masses[index] = cell_masses(upper, finite_or_zero(row_max[index]), scale[index], index)
    shift = finite_or_zero(row_max)
    unsettled = torch.full((len(rows),), -1)  # `draw_tokens`'s answer for a row it cannot draw
    tokens = [-1] * len(rows)
    pending = [i for i, finite in enumerate(row_max[:, 0].isfinite().tolist()) if finite]
    if not pending:
        return tokens
    no_bound = torch.full((len(rows), 1), float("-inf"))
    for proposal in range(MAX_PROPOSALS):
        at = torch.tensor(pending)
        picked = [rows[i] for i in pending]
        proposed = draw_tokens(upper, at, row_max[at], shift[at], scale[at], no_bound[at], masses[at], picked,
                         unsettled[at], stream=2 * proposal)  # fmt: skip
        columns = proposed.clamp(min=0)
        exact = head.logits_at(hidden[at], columns)
        if edited:
            exact = edit_at(exact, columns.tolist(), picked)
        exact = exact.double()
        ratio = torch.exp2((exact - upper[at, columns].double()) * scale[at, 0].double())  # <= 1
        uniforms = torch.tensor([uniform(row, 2 * proposal + 1) for row in picked], dtype=torch.float64)
        rejected = []
        for i, token_id, accepted in zip(pending, proposed.tolist(), (uniforms < ratio).tolist()):
            if token_id >= 0 and accepted:
                tokens[i] = token_id
            elif token_id >= 0:
                rejected.append(i)  # (a row `draw_tokens` cannot draw is left to its full logits)
        pending = rejected
        if not pending:
            break
    return tokens
