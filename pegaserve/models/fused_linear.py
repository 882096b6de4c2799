"""Bias-free linear layers as the engine runs them: several over the same input as one GEMM
(Qwen3's q/k/v, gate/up), and on the CPU in fp32 through the LM head's packed kernel.

At decode batch sizes the BLAS GEMM behind `linear` is far from the CPU's FMA rate on these shapes:
on the AMD EPYC dev machine (2026-12-02, one thread) a [16, 256] x [256, 1536] projection takes
~65 us in the LM head's kernel (`lm_head.CpuLogits`) against ~180-215 us for `linear` or an `mm`
against a transposed copy, 2-2.5x from 16 to 128 rows; ~6% of a decode step. Its results differ from
`linear`'s within fp32 rounding (each output is summed over the inputs in a fixed order), and a
row's result does not depend on the rest of the batch. Where the kernel cannot run (neither AVX-512
nor AVX2), fp32 on the CPU is an `mm` against a contiguous [in, out] copy, faster than `linear` on
Intel and bit-equal to it from 16 rows. The model keeps its Hugging Face parameters (loading stays a name
mapping); this object reads them, and builds its fused copy on first use and again if a weight is
replaced (the loader assigns weights after construction).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegaserve.cpu import lm_head


class FusedLinear:
    """`x -> cat([l(x) for l in linears], -1)` in one GEMM. Not a module: the weights stay the
    `linears`' own parameters (and their names in the state dict)."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self._sources: tuple[torch.Tensor, ...] = ()
        self._weight: torch.Tensor | None = None  # [sum of out_features, in_features]
        self._packed: lm_head.CpuLogits | None = None  # fp32 on an AVX-512/AVX2 CPU: the kernel's packed copy
        self._weight_t: torch.Tensor | None = None  # fp32 on another CPU: its contiguous transpose

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights = tuple(linear.weight for linear in self.linears)
        if len(weights) != len(self._sources) or any(a is not b for a, b in zip(weights, self._sources)):
            self._build(weights)
        if x.dim() == 2 and x.dtype == torch.float32:
            if self._packed is not None:
                return self._packed(x)
            if self._weight_t is not None:
                return torch.mm(x, self._weight_t)
        return F.linear(x, self._weight)

    def _build(self, weights: tuple[torch.Tensor, ...]) -> None:
        weight = weights[0] if len(weights) == 1 else torch.cat([w.detach() for w in weights])
        self._sources, self._weight = weights, weight.detach()
        on_cpu_fp32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        self._packed = lm_head.CpuLogits(self._weight) if on_cpu_fp32 and lm_head.has_kernel() else None
        self._weight_t = self._weight.t().contiguous() if on_cpu_fp32 and self._packed is None else None
