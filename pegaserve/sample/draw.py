"""The sampler's draw: an inverse-CDF sample per row, first of a cell from the row's cell masses, then of a
token inside that cell, with one uniform per row hashed from (seed, position), so that a seeded row's token
depends on nothing else in the batch — nor on a speculative draft (sampler.py's docstring says why).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from pegaserve.sample.passes import CELL, FLOOR, take_values
from pegaserve.sample.processing import SamplingRow

_MASK64 = (1 << 64) - 1
_UNSEEDED = random.SystemRandom()  # unseeded rows' uniforms; stateless, so no hidden state


def draw_tokens(
    source: torch.Tensor,
    row_ids: torch.Tensor | None,
    row_max: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    lower: torch.Tensor,
    masses: torch.Tensor,
    rows: Sequence[SamplingRow],
    fallback: torch.Tensor,
    stream: int = 0,
) -> torch.Tensor:
    """Inverse-CDF draws from the rows `row_ids` of `source` (None: all, in order), at each row's
    temperature (`scale`), keeping its logits at or above `lower`, given its cell masses (all
    `[n, 1]` but those), with each row's uniform number `stream` (`uniform`). A row with no finite
    max or no mass takes `fallback`, its argmax."""
    vocab = source.shape[1]
    masses = masses.double()  # [n, num_cells]
    uniforms = [[uniform(row, stream)] for row in rows]
    target = torch.tensor(uniforms, dtype=torch.float64) * masses.sum(-1, keepdim=True)
    cumulative = masses.cumsum(-1)
    cell = search_cumulative(cumulative, target)  # [n, 1]
    mass = masses.gather(1, cell)
    fraction = ((target - cumulative.gather(1, cell) + mass) / mass).clamp_(0.0, 1.0)  # where in the cell
    columns = cell * CELL + torch.arange(min(CELL, vocab))  # [n, CELL]; the last cell may be short
    outside = columns >= vocab
    values = take_values(source, row_ids, torch.arange(len(rows))[:, None], columns.clamp_(max=vocab - 1))
    exponents = (values - shift).mul_(scale)
    weightless = (exponents <= FLOOR).logical_or_(outside).logical_or_(values < lower)
    within = exponents.double().exp2_().masked_fill_(weightless, 0.0).cumsum_(-1)  # [n, CELL]
    token_ids = columns.gather(1, search_cumulative(within, fraction * within[:, -1:]))
    drawn = row_max.isfinite() & (cumulative[:, -1:] > 0) & (within[:, -1:] > 0)
    return torch.where(drawn, token_ids, fallback[:, None])[:, 0]


def search_cumulative(cumulative: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """`[n, 1]`: the first position whose cumulative weight exceeds the target, or the last
    position with weight when rounding put the target at or past the total."""
    last = torch.searchsorted(cumulative, cumulative[:, -1:].contiguous())  # the first to reach the total
    return torch.searchsorted(cumulative, target, right=True).clamp_(max=last)


def uniform(row: SamplingRow, stream: int = 0) -> float:
    """The row's uniform in [0, 1): a hash of (seed, position, row.stream + stream), or fresh entropy
    when unseeded. Stream 0 is the draw's; a draw by rejection (screened.py) reads more,
    and a row it leaves to the full logits draws there from the streams after them."""
    seed = row.params.seed
    if seed is None:
        return _UNSEEDED.random()
    stream += row.stream
    key = mix64(mix64(seed & _MASK64) ^ (row.num_output_tokens & _MASK64))
    if stream:
        key = mix64(key ^ mix64(stream & _MASK64))
    return (key >> 11) * 2.0**-53


def mix64(x: int) -> int:
    """splitmix64: a bijection of 64-bit integers whose outputs look independent of their inputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)
