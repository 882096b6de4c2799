"""The layers model families share, imported rather than copied: RMSNorm, rotary embedding (its
scaling variants in `ROPE_INV_FREQ`), the gated MLP, the fused linear, and `PagedAttention`, the
seam between a family and the attention backend the engine chose.

Numerics follow transformers' implementations of the families that use them (Qwen3 first):
a family's test compares its greedy tokens with transformers' own class.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pegaserve.attention.backend import AttentionBackend, AttentionBatch, AttentionSpec, QKNormRope
from pegaserve.models.fused_linear import FusedLinear

__all__ = ["ROPE_INV_FREQ", "FusedLinear", "GatedMLP", "PagedAttention", "RMSNorm", "Rotary", "qk_norm_rope"]


class RMSNorm(nn.Module):
    """`weight * x / rms(x)`, normalized in fp32 and cast back before the weight (as Qwen3's)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """RoPE's inverse frequencies `theta^(-2i/head_dim)`: `[head_dim // 2]` fp32."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (theta**exponents)


# rope_type (config.json's `rope_parameters` / `rope_scaling`) -> its inverse frequencies; a scaling
# variant (linear, dynamic, yarn, llama3, ...) is one function and one line here
ROPE_INV_FREQ: dict[str, Callable[[int, float], torch.Tensor]] = {
    "default": default_inv_freq,
}


class Rotary(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by position.

    The tables are built on the CPU even under a meta-device context (the loader builds the model
    on the meta device), so the loader only moves them to the model's device."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, rope_type: str = "default") -> None:
        super().__init__()
        inv_freq = ROPE_INV_FREQ[rope_type](head_dim, theta)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim]
        cos = self.cos[positions][:, None, :].to(x.dtype)  # [num_tokens, 1, head_dim]
        sin = self.sin[positions][:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def qk_norm_rope(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    q_norm: RMSNorm,
    k_norm: RMSNorm,
    rotary: Rotary,
    positions: torch.Tensor,  # [num_tokens]
    fused: QKNormRope | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k, then RoPE (Qwen3's q/k path): the backend's `fused` kernel where
    it has one (`AttentionBackend.qk_norm_rope`), else these modules, its reference."""
    if fused is None:
        return rotary(q_norm(q), positions), rotary(k_norm(k), positions)
    assert q_norm.eps == k_norm.eps
    return fused(q, k, q_norm.weight, k_norm.weight, rotary.cos, rotary.sin, positions, q_norm.eps)


class GatedMLP(nn.Module):
    """`down(silu(gate(x)) * up(x))`, with Hugging Face's names; gate and up run as one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.gate_up = FusedLinear(self.gate_proj, self.up_proj)
        self.down = FusedLinear(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [num_tokens, intermediate] each
        return self.down(F.silu(gate) * up)  # [num_tokens, hidden]


class PagedAttention:
    """Where a family's layer attends: its `AttentionSpec`, checked against the engine's backend as
    the model is built, then the backend's store-and-attend over the paged cache at every step.
    Not a module (it has no parameters, and a module's call costs more per layer and step)."""

    def __init__(self, backend: AttentionBackend, spec: AttentionSpec) -> None:
        backend.check(spec)
        self.backend = backend
        self.spec = spec

    def __call__(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        batch: AttentionBatch,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        return self.backend.forward(q, k, v, kv_layer, batch, self.spec)
