"""Fused RMSNorm kernels for Qwen3's per-token elementwise work, where eager torch spends a launch
per op: the residual add + RMSNorm before attention and MLP, and Qwen3's per-head q/k RMSNorm +
rotate-half RoPE. Numerics follow `pegaserve.models.qwen3`: normalize in fp32, cast to the model
dtype, then scale by the weight in that dtype; RoPE tables are the model's fp32 cos/sin.

Where they run: `qk_norm_rope` is the `triton` backend's `AttentionBackend.qk_norm_rope`, so on
CUDA every layer's q/k norms and rotations are one launch. `add_rms_norm` is not wired: fusing the
residual add into the norm means threading the residual through the model's forward (vLLM's
`norm(x, residual)` style), which would make Qwen3's residual stream harder to read for one
launch per norm; with no GPU lent to measure the gain, the model keeps its plain torch residuals.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from .checks import ATTENTION_DTYPES, INDEX_DTYPES, check_same_dtype, check_tensor, next_pow2


@triton.jit
def add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    stride_x,
    stride_residual,
    stride_out,
    stride_residual_out,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One program per row: s = x (+ residual), stored; out = weight * rmsnorm(s)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    s = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        s = (s.to(tl.float32) + r.to(tl.float32)).to(s.dtype)  # the eager add rounds to the model dtype
        tl.store(residual_out_ptr + row * stride_residual_out + cols, s, mask=mask)
    s32 = s.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(s32 * s32, 0) / HIDDEN + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = (s32 * inv_rms).to(s.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(s), s) with s = x + residual (or x). x, residual: [num_rows, hidden]."""
    device = x.device
    check_tensor("x", x, shape=(None, None), dtypes=ATTENTION_DTYPES, device=device)
    num_rows, hidden = x.shape
    check_tensor("weight", weight, shape=(hidden,), dtypes=(x.dtype,), device=device)
    if residual is not None:
        check_tensor("residual", residual, shape=(num_rows, hidden), dtypes=(x.dtype,), device=device)
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    if num_rows > 0:
        add_rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, out, summed, eps,
            x.stride(0), (residual if residual is not None else x).stride(0), out.stride(0), summed.stride(0),
            HIDDEN=hidden, BLOCK=next_pow2(hidden), HAS_RESIDUAL=residual is not None,
        )  # fmt: skip
    return out, summed


def add_rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec: qwen3's `RMSNorm` applied to `x + residual`."""
    s = x if residual is None else x + residual
    s32 = s.float()
    return weight * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype), s


@triton.jit
def _norm_rope_heads(
    x_ptr,
    out_ptr,
    stride_x_head,
    stride_out_head,
    weight_ptr,
    cos_ptr,
    sin_ptr,
    eps,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Every head of one token: RMSNorm over head_dim, then rotate-half RoPE at its position."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HALF)
    lo = heads * stride_x_head + dims  # first half of each head; the second half is HALF further
    x1 = tl.load(x_ptr + lo, mask=mask, other=0.0)
    x2 = tl.load(x_ptr + lo + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
    inv_rms = tl.rsqrt((tl.sum(a1 * a1, 1) + tl.sum(a2 * a2, 1)) / (2 * HALF) + eps)[:, None]
    half_mask = dims < HALF
    w1 = tl.load(weight_ptr + dims, mask=half_mask, other=0.0).to(tl.float32)
    w2 = tl.load(weight_ptr + HALF + dims, mask=half_mask, other=0.0).to(tl.float32)
    # each eager op rounds to the model dtype: norm, weight, x * cos, rot * sin, their sum
    y1 = ((a1 * inv_rms).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
    y2 = ((a2 * inv_rms).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    c1 = tl.load(cos_ptr + dims, mask=half_mask, other=0.0).to(dtype).to(tl.float32)
    c2 = tl.load(cos_ptr + HALF + dims, mask=half_mask, other=0.0).to(dtype).to(tl.float32)
    s1 = tl.load(sin_ptr + dims, mask=half_mask, other=0.0).to(dtype).to(tl.float32)
    s2 = tl.load(sin_ptr + HALF + dims, mask=half_mask, other=0.0).to(dtype).to(tl.float32)
    o1 = (y1 * c1).to(dtype).to(tl.float32) + (-y2 * s1).to(dtype).to(tl.float32)
    o2 = (y2 * c2).to(dtype).to(tl.float32) + (y1 * s2).to(dtype).to(tl.float32)
    out_lo = heads * stride_out_head + dims
    tl.store(out_ptr + out_lo, o1.to(dtype), mask=mask)
    tl.store(out_ptr + out_lo + HALF, o2.to(dtype), mask=mask)


@triton.jit
def qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_weight_ptr,
    k_weight_ptr,
    cos_ptr,
    sin_ptr,
    positions_ptr,
    eps,
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_table,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KVH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """One program per token: its q heads and k heads. Outputs are contiguous [T, heads, hd]."""
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cos_row, sin_row = cos_ptr + pos * stride_table, sin_ptr + pos * stride_table
    q_out = q_out_ptr + token * NUM_HEADS * 2 * HALF
    k_out = k_out_ptr + token * NUM_KV_HEADS * 2 * HALF
    _norm_rope_heads(
        q_ptr + token * stride_q_token, q_out, stride_q_head, 2 * HALF, q_weight_ptr, cos_row, sin_row, eps,
        NUM_HEADS, HALF, BLOCK_H, BLOCK_HALF,
    )  # fmt: skip
    _norm_rope_heads(
        k_ptr + token * stride_k_token, k_out, stride_k_head, 2 * HALF, k_weight_ptr, cos_row, sin_row, eps,
        NUM_KV_HEADS, HALF, BLOCK_KVH, BLOCK_HALF,
    )  # fmt: skip


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's q/k path after the projections: per-head RMSNorm, then RoPE at `positions`.

    q [T, H, hd], k [T, KVH, hd]; weights [hd]; cos, sin [max_positions, hd] fp32 (the model's
    `Rotary` tables); positions [T]. Returns new contiguous q, k. Caller's invariant (device values,
    not checked): every position is below max_positions.
    """
    device = q.device
    check_tensor("q", q, shape=(None, None, None), dtypes=ATTENTION_DTYPES, device=device)
    num_tokens, num_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"q: head_dim {head_dim} must be even for rotate-half RoPE")
    check_tensor("k", k, shape=(num_tokens, None, head_dim), dtypes=(q.dtype,), device=device)
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        check_tensor(name, w, shape=(head_dim,), dtypes=ATTENTION_DTYPES, device=device)
        check_same_dtype(name, w, q.dtype, "q")
    check_tensor("cos", cos, shape=(None, head_dim), dtypes=(torch.float32,), device=device)
    check_tensor("sin", sin, shape=tuple(cos.shape), dtypes=(torch.float32,), device=device)
    if sin.stride() != cos.stride():
        raise ValueError(f"sin: strides {sin.stride()} differ from cos's {cos.stride()}")
    check_tensor("positions", positions, shape=(num_tokens,), dtypes=INDEX_DTYPES, device=device)
    q_out, k_out = (
        torch.empty(q.shape, dtype=q.dtype, device=device),
        torch.empty(k.shape, dtype=k.dtype, device=device),
    )
    if num_tokens > 0:
        qk_norm_rope_kernel[(num_tokens,)](
            q, k, q_out, k_out, q_weight, k_weight, cos, sin, positions, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
            NUM_HEADS=num_heads, NUM_KV_HEADS=k.shape[1], HALF=head_dim // 2,
            BLOCK_H=next_pow2(num_heads), BLOCK_KVH=next_pow2(k.shape[1]), BLOCK_HALF=next_pow2(head_dim // 2),
        )  # fmt: skip
    return q_out, k_out


def qk_norm_rope_reference(q, k, q_weight, k_weight, cos, sin, positions, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec: qwen3's `RMSNorm` per head, then its `Rotary` (rotate-half, tables cast to dtype)."""

    def norm_rope(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        c = cos[positions][:, None, :].to(x.dtype)  # [T, 1, hd]
        s = sin[positions][:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * c + torch.cat((-x2, x1), dim=-1) * s

    return norm_rope(q, q_weight), norm_rope(k, k_weight)
