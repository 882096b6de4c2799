"""Causal attention for a batch of variable-length prompts over the paged cache.

The step's K/V are already in the cache (store first, then attend), so one code path serves a
fresh prompt and a prompt continuing after a cached prefix: request i has `query_lens[i]` queries
and `context_lens[i]` cached tokens in all (prefix + new); its query j sits at position
`context_lens[i] - query_lens[i] + j` and sees keys `0..position`.

Queries are flattened `[num_tokens, num_heads, head_dim]`; request i owns rows
`query_start_loc[i]:query_start_loc[i + 1]`.
"""

from __future__ import annotations

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

LOG2_E = 1.4426950408889634


@triton.jit
def prefill_attention_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,
    stride_q_token,
    stride_q_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_req,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (request, query head, query tile): online softmax over key tiles up to its diagonal."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    tile_m = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req).to(tl.int64)
    q_len = (tl.load(query_start_loc_ptr + req + 1) - q_start).to(tl.int32)
    ctx_len = tl.load(context_lens_ptr + req).to(tl.int32)
    rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the request
    row_valid = rows < q_len
    q_pos = ctx_len - q_len + rows  # absolute position of each query
    # keys this tile can see end at its last real query's position; an empty tile sees none
    last_row = tl.minimum((tile_m + 1) * BLOCK_M, q_len)
    key_end = tl.where(tile_m * BLOCK_M < q_len, ctx_len - q_len + last_row, 0)

    dims = tl.arange(0, BLOCK_D)
    dim_valid = dims < HEAD_DIM
    q_ptrs = q_ptr + (q_start + rows)[:, None] * stride_q_token + head * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    kv_base = cache_ptr + (head // GROUP) * stride_cache_head
    table = block_tables_ptr + req.to(tl.int64) * stride_table_req
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for tile_start in range(0, key_end, BLOCK_N):
        pos = tile_start + tl.arange(0, BLOCK_N)
        key_valid = pos < key_end
        block_ids = tl.load(table + pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        offsets = block_ids[:, None] * stride_cache_block + (pos % BLOCK_SIZE)[:, None] * stride_cache_slot
        offsets = offsets + dims[None, :]
        kv_mask = key_valid[:, None] & dim_valid[None, :]
        k = tl.load(kv_base + offsets, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(kv_base + stride_cache_kv + offsets, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = key_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        # key 0 is in the first tile and visible to every row, so m_new is finite from then on
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + (q_start + rows)[:, None] * stride_out_token + head * stride_out_head + dims[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


def _tiles(device: torch.device, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): tensor-core tiles for half types on CUDA, smaller ones for
    fp32 (no tensor cores at ieee precision), the smallest dot tiles when interpreted."""
    if device.type != "cuda":
        return 16, 16, 1
    return (64, 64, 4) if dtype != torch.float32 else (32, 32, 4)


def prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    max_query_len: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of `q` [num_tokens, num_heads, head_dim] over each request's paged context.

    `block_tables` [num_reqs, max_blocks], `context_lens` [num_reqs], `query_start_loc`
    [num_reqs + 1] (cumulative query lengths from 0 to num_tokens). Returns `out`, shaped like q.
    Caller's invariants (device values, not checked): `1 <= query_lens[i] <= context_lens[i]`,
    `max(query_lens) <= max_query_len`, the first `cdiv(context_lens[i], block_size)` entries of
    row i are valid block ids, and the K/V of all those positions are already stored.
    """
    device = kv_layer.device
    check_tensor("kv_layer", kv_layer, shape=(2, None, None, None, None), dtypes=ATTENTION_DTYPES, device=device)
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    check_tensor("q", q, shape=(None, None, head_dim), dtypes=ATTENTION_DTYPES, device=device)
    check_same_dtype("q", q, kv_layer.dtype, "kv_layer")
    num_tokens, num_heads, _ = q.shape
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"q: {num_heads} heads is not a multiple of kv_layer's {num_kv_heads} kv heads")
    check_tensor("block_tables", block_tables, shape=(None, None), dtypes=INDEX_DTYPES, device=device)
    num_reqs = block_tables.shape[0]
    check_tensor("context_lens", context_lens, shape=(num_reqs,), dtypes=INDEX_DTYPES, device=device)
    check_tensor("query_start_loc", query_start_loc, shape=(num_reqs + 1,), dtypes=INDEX_DTYPES, device=device)
    check_positive("max_query_len", max_query_len)
    if out is None:
        out = torch.empty_like(q)
    check_tensor("out", out, shape=tuple(q.shape), dtypes=(q.dtype,), device=device)
    if num_tokens == 0 or num_reqs == 0:
        return out
    block_m, block_n, num_warps = _tiles(device, q.dtype)
    grid = (num_reqs, num_heads, cdiv(max_query_len, block_m))
    prefill_attention_kernel[grid](
        q, kv_layer, block_tables, context_lens, query_start_loc, out,
        scale * LOG2_E,
        q.stride(0), q.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, next_pow2(head_dim)),
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
    )  # fmt: skip
    return out


def paged_attention_reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """The spec for both attention kernels: per request, gather its context from the block table,
    softmax in fp32 with query j masked to positions `<= context_len - query_len + j`."""
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q)
    start = 0
    for i, q_len in enumerate(query_lens):
        ctx_len = int(context_lens[i])
        block_ids = block_tables[i, : cdiv(ctx_len, block_size)]
        kv = kv_layer[:, block_ids].reshape(2, -1, num_kv_heads, head_dim)[:, :ctx_len].float()  # [2, ctx, kvh, hd]
        kv = kv.repeat_interleave(group, dim=2)  # [2, ctx, H, hd]
        q_i = q[start : start + q_len].float()  # [q_len, H, hd]
        scores = torch.einsum("qhd,khd->hqk", q_i, kv[0]) * scale  # [H, q_len, ctx]
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        visible = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]  # [q_len, ctx]
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", probs, kv[1]).to(q.dtype)
        start += q_len
    return out


def prefill_attention_reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The spec of `prefill_attention` (same arguments, less the launch hints)."""
    query_lens = query_start_loc.diff().tolist()
    return paged_attention_reference(q, kv_layer, block_tables, context_lens, query_lens, scale)
