"""Store the K/V of a step's new tokens into one layer's paged cache, by slot mapping.

Cache layout (one layer): `kv_layer[2, num_blocks, block_size, num_kv_heads, head_dim]`, index 0 K,
1 V. Token t goes to slot `slot_mapping[t] = block_id * block_size + offset`.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from .checks import ATTENTION_DTYPES, INDEX_DTYPES, check_same_dtype, check_tensor, next_pow2


@triton.jit
def store_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_mapping_ptr,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_kv,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per token: its [num_kv_heads, head_dim] K and V tiles to their cache slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :], mask=mask)
    dst = cache_ptr + block * stride_cache_block + offset * stride_cache_slot
    dst = dst + heads[:, None] * stride_cache_head + dims[None, :]
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_cache_kv, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write `k`, `v` ([num_tokens, num_kv_heads, head_dim]) into `kv_layer` at `slot_mapping`.

    Caller's invariants (not checked: they live on the device): every slot is in
    `[0, num_blocks * block_size)` and no slot repeats within one call.
    """
    check_tensor(
        "kv_layer", kv_layer, shape=(2, None, None, None, None), dtypes=ATTENTION_DTYPES, device=kv_layer.device
    )
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    check_tensor("k", k, shape=(None, num_kv_heads, head_dim), dtypes=ATTENTION_DTYPES, device=kv_layer.device)
    check_same_dtype("k", k, kv_layer.dtype, "kv_layer")
    num_tokens = k.shape[0]
    check_tensor("v", v, shape=(num_tokens, num_kv_heads, head_dim), dtypes=(k.dtype,), device=kv_layer.device)
    check_tensor("slot_mapping", slot_mapping, shape=(num_tokens,), dtypes=INDEX_DTYPES, device=kv_layer.device)
    if num_tokens == 0:
        return
    store_kv_kernel[(num_tokens,)](
        k, v, kv_layer, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2), kv_layer.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=next_pow2(num_kv_heads),
        BLOCK_D=next_pow2(head_dim),
    )  # fmt: skip


def store_kv_reference(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The spec: the cache seen as [2, num_slots, kvh, hd] gets row `slot_mapping[t]` = token t."""
    num_slots = kv_layer.shape[1] * kv_layer.shape[2]
    flat = kv_layer.view(2, num_slots, *kv_layer.shape[3:])  # [2, num_slots, kvh, hd]
    flat[0][slot_mapping] = k
    flat[1][slot_mapping] = v
