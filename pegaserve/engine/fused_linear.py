"""Bias-free linear layers as the engine runs them: several over the same input as one GEMM
(Qwen3's q/k/v, gate/up), and on the CPU in fp32 as a plain `mm` against a transposed copy.

A `linear` on the CPU hands its [out, in] weight to the GEMM as a transposed operand; at decode
batch sizes that costs more than the arithmetic. An `mm` against a contiguous [in, out] copy does
not: a [16, 256] x [256, 1536] projection takes ~105 us against `linear`'s ~220 and oneDNN's
prepacked ~230 on the dev machine (2026-12-02), and from 16 rows up its results are bit-equal to
`linear`'s (oneDNN's are not, with 768 inputs). The model keeps its Hugging Face parameters
(loading stays a name mapping); this object reads them, and builds its fused, transposed copy on
first use and again if a weight is replaced (the loader assigns weights after construction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class FusedLinear:
    """`x -> cat([l(x) for l in linears], -1)` in one GEMM. Not a module: the weights stay the
    `linears`' own parameters (and their names in the state dict)."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self._sources: tuple[torch.Tensor, ...] = ()
        self._weight: torch.Tensor | None = None  # [sum of out_features, in_features]
        self._weight_t: torch.Tensor | None = None  # its contiguous transpose (fp32 on the CPU), or None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights = tuple(linear.weight for linear in self.linears)
        if len(weights) != len(self._sources) or any(a is not b for a, b in zip(weights, self._sources)):
            self._build(weights)
        if self._weight_t is not None and x.dim() == 2 and x.dtype == torch.float32:
            return torch.mm(x, self._weight_t)
        return F.linear(x, self._weight)

    def _build(self, weights: tuple[torch.Tensor, ...]) -> None:
        weight = weights[0] if len(weights) == 1 else torch.cat([w.detach() for w in weights])
        self._sources, self._weight = weights, weight.detach()
        on_cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        self._weight_t = self._weight.t().contiguous() if on_cpu_fp32 else None
