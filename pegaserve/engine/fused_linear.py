"""Bias-free linear layers as the engine runs them: several over the same input as one GEMM
(Qwen3's q/k/v, gate/up), and on the CPU in fp32 through oneDNN's prepacked weights.

A plain `linear` on the CPU repacks its weight on every call; at decode batch sizes that costs
more than the arithmetic (a [16, 256] x [256, 768] projection: ~145 us plain, ~55 us prepacked on
the dev machine). The model keeps its Hugging Face parameters (loading stays a name mapping);
this object reads them, and builds its fused, packed copy on first use and again if a weight is
replaced (the loader assigns weights after construction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

_HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class FusedLinear:
    """`x -> cat([l(x) for l in linears], -1)` in one GEMM. Not a module: the weights stay the
    `linears`' own parameters (and their names in the state dict)."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self._sources: tuple[torch.Tensor, ...] = ()
        self._weight: torch.Tensor | None = None  # [sum of out_features, in_features]
        self._packed: torch.Tensor | None = None  # oneDNN's blocked copy (fp32 on the CPU), or None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights = tuple(linear.weight for linear in self.linears)
        if len(weights) != len(self._sources) or any(a is not b for a, b in zip(weights, self._sources)):
            self._build(weights)
        if self._packed is not None and x.dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")
        return F.linear(x, self._weight)

    def _build(self, weights: tuple[torch.Tensor, ...]) -> None:
        weight = weights[0] if len(weights) == 1 else torch.cat([w.detach() for w in weights])
        self._sources, self._weight = weights, weight.detach()
        on_cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32 and _HAS_ONEDNN
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self._weight, 16) if on_cpu_fp32 else None
