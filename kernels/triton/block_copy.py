"""The KV handoff's pack and unpack: gather a request's blocks from the whole cache into one
contiguous buffer, and scatter such a buffer into (other) blocks of another cache.

Whole cache: `kv_cache[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`.
Packed: `[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]`, contiguous — the
layout `ModelRunner.export_blocks` produces and `import_blocks` takes. One block of one layer's K
(or V) is a contiguous chunk of `block_size * num_kv_heads * head_dim` elements in both.
"""

from __future__ import annotations

import torch

import triton
import triton.language as tl

from .checks import ATTENTION_DTYPES, INDEX_DTYPES, cdiv, check_same_dtype, check_tensor

CHUNK_TILE = 4096  # elements per program: 8 KiB of bf16, 16-byte vector loads over 4 warps


@triton.jit
def copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    block_ids_ptr,
    stride_src_layer,
    stride_src_kv,
    stride_src_block,
    stride_dst_layer,
    stride_dst_kv,
    stride_dst_block,
    CHUNK: tl.constexpr,
    TILE: tl.constexpr,
    GATHER: tl.constexpr,
):
    """Program (layer * 2 + kv, i, tile): one tile of block i's chunk. GATHER reads cache block
    `block_ids[i]` into packed slot i; otherwise packed slot i goes to cache block `block_ids[i]`."""
    layer_kv = tl.program_id(0)
    i = tl.program_id(1).to(tl.int64)
    elems = tl.program_id(2) * TILE + tl.arange(0, TILE)
    mask = elems < CHUNK
    block = tl.load(block_ids_ptr + i).to(tl.int64)
    if GATHER:
        src_block = block
        dst_block = i
    else:
        src_block = i
        dst_block = block
    layer = (layer_kv // 2).to(tl.int64)
    kv = layer_kv % 2
    src = src_ptr + layer * stride_src_layer + kv * stride_src_kv + src_block * stride_src_block
    dst = dst_ptr + layer * stride_dst_layer + kv * stride_dst_kv + dst_block * stride_dst_block
    tl.store(dst + elems, tl.load(src + elems, mask=mask), mask=mask)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack `kv_cache[:, :, block_ids]` into a contiguous `[L, 2, n, bs, kvh, hd]` buffer.

    Caller's invariant (device values, not checked): every id is in `[0, num_blocks)`.
    """
    _check_cache("kv_cache", kv_cache)
    check_tensor("block_ids", block_ids, shape=(None,), dtypes=INDEX_DTYPES, device=kv_cache.device)
    shape = _packed_shape(kv_cache, block_ids.shape[0])
    if out is None:
        out = torch.empty(shape, dtype=kv_cache.dtype, device=kv_cache.device)
    _check_packed("out", out, shape, kv_cache)
    _launch(kv_cache, out, block_ids, gather=True)
    return out


def scatter_blocks(packed: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """Unpack: `kv_cache[:, :, block_ids] = packed`, packed as `gather_blocks` returns it.

    Caller's invariants (device values, not checked): ids in `[0, num_blocks)`, none repeated.
    """
    _check_cache("kv_cache", kv_cache)
    check_tensor("block_ids", block_ids, shape=(None,), dtypes=INDEX_DTYPES, device=kv_cache.device)
    _check_packed("packed", packed, _packed_shape(kv_cache, block_ids.shape[0]), kv_cache)
    _launch(packed, kv_cache, block_ids, gather=False)


def _launch(src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, gather: bool) -> None:
    num_layers, _, _, block_size, num_kv_heads, head_dim = src.shape
    num_ids = block_ids.shape[0]
    chunk = block_size * num_kv_heads * head_dim
    if num_ids == 0 or num_layers == 0:
        return
    tile = min(CHUNK_TILE, triton.next_power_of_2(chunk))
    copy_blocks_kernel[(num_layers * 2, num_ids, cdiv(chunk, tile))](
        src, dst, block_ids,
        src.stride(0), src.stride(1), src.stride(2),
        dst.stride(0), dst.stride(1), dst.stride(2),
        CHUNK=chunk, TILE=tile, GATHER=gather,
    )  # fmt: skip


def _check_cache(name: str, kv_cache: torch.Tensor) -> None:
    check_tensor(
        name, kv_cache, shape=(None, 2, None, None, None, None), dtypes=ATTENTION_DTYPES, device=kv_cache.device
    )
    _check_blocks_contiguous(name, kv_cache)


def _check_packed(name: str, packed: torch.Tensor, shape: tuple[int, ...], kv_cache: torch.Tensor) -> None:
    check_tensor(name, packed, shape=shape, dtypes=ATTENTION_DTYPES, device=kv_cache.device)
    check_same_dtype(name, packed, kv_cache.dtype, "kv_cache")
    _check_blocks_contiguous(name, packed)


def _check_blocks_contiguous(name: str, t: torch.Tensor) -> None:
    """Each block (the trailing [block_size, kvh, hd]) must be one dense chunk."""
    *_, num_kv_heads, head_dim = t.shape
    dense = (num_kv_heads * head_dim, head_dim, 1)
    if any(size > 1 and stride != want for size, stride, want in zip(t.shape[3:], t.stride()[3:], dense)):
        raise ValueError(f"{name}: each block must be contiguous, got strides {t.stride()}")


def _packed_shape(kv_cache: torch.Tensor, num_ids: int) -> tuple[int, ...]:
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return (num_layers, 2, num_ids, block_size, num_kv_heads, head_dim)


def gather_blocks_reference(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """The spec of `gather_blocks`."""
    return kv_cache[:, :, block_ids].contiguous()


def scatter_blocks_reference(packed: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> None:
    """The spec of `scatter_blocks`."""
    kv_cache[:, :, block_ids] = packed
