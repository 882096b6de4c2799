"""Paged decode attention: one query per request over its whole paged context (flash-decoding).

Decode is memory-bound: each step reads every cached K/V byte of the batch once. So one program
owns (request, kv head, context split) and serves all `group = num_heads // num_kv_heads` query
heads that share that kv head — each K/V tile is loaded once, not once per query head — and long
contexts are split across programs (split-K) so a small batch still fills the GPU. A second tiny
kernel merges the splits by their log-sum-exp. Tiles are `BLOCK_N` tokens gathered through the
block table, so they may span several cache blocks and any block size works.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

import triton
import triton.language as tl

from .checks import (
    ATTENTION_DTYPES,
    INDEX_DTYPES,
    cdiv,
    check_positive,
    check_same_dtype,
    check_tensor,
    dot_precision,
    next_pow2,
)
from .prefill_attention import LOG2_E, paged_attention_reference

MAX_SPLITS = 64


@triton.jit(do_not_specialize=["num_splits"])  # one binary whatever the split count
def decode_split_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    split_len,
    num_splits,
    stride_q_req,
    stride_q_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_req,
    stride_out_req,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (request, kv head, split): online softmax of the group's queries over its split.
    `num_splits` and `split_len` are runtime values, so growing contexts never trigger a recompile."""
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(context_lens_ptr + req).to(tl.int32)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx_len)

    groups = tl.arange(0, BLOCK_G)
    heads = kv_head * GROUP + groups
    dims = tl.arange(0, BLOCK_D)
    head_mask = (groups < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + req * stride_q_req + heads[:, None] * stride_q_head + dims[None, :], mask=head_mask, other=0.0)

    kv_base = cache_ptr + kv_head * stride_cache_head
    table = block_tables_ptr + req * stride_table_req
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        valid = pos < end
        block_ids = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        offsets = block_ids[:, None] * stride_cache_block + (pos % BLOCK_SIZE)[:, None] * stride_cache_slot
        offsets = offsets + dims[None, :]
        kv_mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
        k = tl.load(kv_base + offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(kv_base + stride_cache_kv + offsets, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_G, BLOCK_N]
        s = tl.where(valid[None, :], s, float("-inf"))
        # every tile holds at least one valid token, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0  # false only for a split that starts past this request's context
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if not SPLIT:
        out_ptrs = out_ptr + req * stride_out_req + heads[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=head_mask)
    else:
        # partials: part_out [num_reqs, num_heads, num_splits, BLOCK_D], part_lse [num_reqs, num_heads, num_splits]
        row = (req * GROUP * tl.num_programs(1) + heads) * num_splits + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + dims[None, :], out, mask=head_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=groups < GROUP)


@triton.jit(do_not_specialize=["num_splits"])
def decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_out_req,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program (request, head): weight each split's output by exp2(lse - max lse)."""
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    row = (req * tl.num_programs(1) + head) * num_splits
    lse = tl.load(part_lse_ptr + row + splits, mask=splits < num_splits, other=float("-inf"))
    weights = tl.exp2(lse - tl.max(lse, 0))  # split 0 always has keys, so the max is finite
    parts = tl.load(
        part_out_ptr + (row + splits)[:, None] * BLOCK_D + dims[None, :],
        mask=(splits < num_splits)[:, None] & (dims < HEAD_DIM)[None, :],
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + req * stride_out_req + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


@dataclass(frozen=True)
class DecodeLaunch:
    """How one call is cut up: `num_splits` programs of `split_len` tokens per (request, kv head)."""

    num_splits: int
    split_len: int
    block_n: int
    num_warps: int


def plan_splits(
    num_reqs: int, num_kv_heads: int, max_context_len: int, block_n: int, target_programs: int
) -> tuple[int, int]:
    """(num_splits, split_len): enough programs to fill the device, each split a whole number of
    tiles, no split past the longest context."""
    num_tiles = cdiv(max_context_len, block_n)
    num_splits = max(1, min(num_tiles, cdiv(target_programs, num_reqs * num_kv_heads), MAX_SPLITS))
    split_len = cdiv(num_tiles, num_splits) * block_n
    return cdiv(max_context_len, split_len), split_len


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _plan_launch(
    device: torch.device,
    dtype: torch.dtype,
    num_reqs: int,
    num_kv_heads: int,
    max_context_len: int,
    num_splits: int | None,
    block_n: int | None,
    num_warps: int | None,
) -> DecodeLaunch:
    """The caller's overrides, else device defaults: on CUDA 64-token tiles (32 in fp32), 4 warps
    and about 4 programs per SM; interpreted, one program per (request, kv head), as each runs in
    Python."""
    on_gpu = device.type == "cuda"
    block_n = block_n or ((64 if dtype != torch.float32 else 32) if on_gpu else 16)
    num_warps = num_warps or (4 if on_gpu else 1)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n: expected a power of two >= 16, got {block_n}")
    if num_warps & (num_warps - 1):
        raise ValueError(f"num_warps: expected a power of two, got {num_warps}")
    if num_splits is not None:
        check_positive("num_splits", num_splits)
        target_programs = num_splits * num_reqs * num_kv_heads
    else:
        target_programs = 4 * _num_sms(device.index or 0) if on_gpu else 1
    num_splits, split_len = plan_splits(num_reqs, num_kv_heads, max_context_len, block_n, target_programs)
    return DecodeLaunch(num_splits, split_len, block_n, num_warps)


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    max_context_len: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `q` [num_reqs, num_heads, head_dim] (each request's newest token) over its
    whole paged context; returns `out`, shaped like q.

    `kv_layer` [2, num_blocks, block_size, num_kv_heads, head_dim], `block_tables`
    [num_reqs, max_blocks], `context_lens` [num_reqs]. `num_splits`, `block_n` and `num_warps`
    override the device's launch plan (for tests and tuning). Caller's invariants (device values,
    not checked): `1 <= context_lens[i] <= max_context_len` and the first
    `cdiv(context_lens[i], block_size)` entries of block table row i are valid block ids.
    """
    device = kv_layer.device
    check_tensor("kv_layer", kv_layer, shape=(2, None, None, None, None), dtypes=ATTENTION_DTYPES, device=device)
    *_, num_kv_heads, head_dim = kv_layer.shape
    check_tensor("q", q, shape=(None, None, head_dim), dtypes=ATTENTION_DTYPES, device=device)
    check_same_dtype("q", q, kv_layer.dtype, "kv_layer")
    num_reqs, num_heads, _ = q.shape
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"q: {num_heads} heads is not a multiple of kv_layer's {num_kv_heads} kv heads")
    check_tensor("block_tables", block_tables, shape=(num_reqs, None), dtypes=INDEX_DTYPES, device=device)
    check_tensor("context_lens", context_lens, shape=(num_reqs,), dtypes=INDEX_DTYPES, device=device)
    check_positive("max_context_len", max_context_len)
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, shape=tuple(q.shape), dtypes=(q.dtype,), device=device)
    launch = _plan_launch(device, q.dtype, num_reqs, num_kv_heads, max_context_len, num_splits, block_n, num_warps)
    if num_reqs > 0:
        _launch(q, kv_layer, block_tables, context_lens, scale, out, launch)
    return out


def _launch(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    launch: DecodeLaunch,
) -> None:
    num_reqs, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_layer.shape
    group = num_heads // num_kv_heads
    block_d = max(16, next_pow2(head_dim))
    split = launch.num_splits > 1
    part_out = part_lse = out  # unused with one split: the kernel writes `out` itself
    if split:
        part_out = torch.empty((num_reqs, num_heads, launch.num_splits, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_reqs, num_heads, launch.num_splits), dtype=torch.float32, device=q.device)
    decode_split_kernel[(num_reqs, num_kv_heads, launch.num_splits)](
        q, kv_layer, block_tables, context_lens, out, part_out, part_lse,
        scale * LOG2_E, launch.split_len, launch.num_splits,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, next_pow2(group)),  # tl.dot needs 16 rows; padded heads are masked
        BLOCK_N=launch.block_n,
        BLOCK_D=block_d,
        SPLIT=split,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=launch.num_warps,
    )  # fmt: skip
    if split:
        decode_merge_kernel[(num_reqs, num_heads)](
            part_out, part_lse, out, launch.num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=MAX_SPLITS,
        )  # fmt: skip


def paged_decode_attention_reference(
    q: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """The spec: each request's single query attends to all `context_lens[i]` positions."""
    return paged_attention_reference(q, kv_layer, block_tables, context_lens, [1] * q.shape[0], scale)
