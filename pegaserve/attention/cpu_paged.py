"""Decode attention on the CPU through the kernel `csrc/paged_attention.cpp`: each query
reads its request's keys and values in place in the paged cache, where the torch path copies every
context out of the cache (index_select) and pads them all to the longest for one SDPA call.

`attend` answers None where the kernel cannot run (neither AVX-512 nor AVX2, not fp32 on the CPU, a head size it
does not take): the caller uses SDPA, its reference (tests/engine/test_cpu_attention.py).
"""

from __future__ import annotations

import torch

from pegaserve.cpu import kernels


def _library():
    return kernels.paged_attention()


def attend(
    q: torch.Tensor,  # [their tokens, H, hd]: the queries of `requests`, in order
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, kvh, hd]
    block_tables: torch.Tensor,  # [num_requests, max_blocks] int64
    context_lens: list[int],
    query_lens: list[int],
    scale: float,
) -> torch.Tensor | None:  # [their tokens, H, hd]
    library = _library()
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
    num_heads = q.shape[1]
    if (library is None or q.dtype != torch.float32 or kv_layer.dtype != torch.float32 or q.device.type != "cpu"
            or kv_layer.device.type != "cpu" or not kv_layer.is_contiguous() or head_dim % 16
            or head_dim > library.pegaserve_paged_attention_max_head_dim() or num_heads % num_kv_heads):
        return None
    q = q.contiguous()
    tables = block_tables.to(torch.long).contiguous()
    starts = [0]
    for n in query_lens[:-1]:
        starts.append(starts[-1] + n)
    lens = torch.tensor([context_lens, starts, query_lens], dtype=torch.long)  # [3, num_requests]
    out = torch.empty_like(q)
    library.pegaserve_paged_attention(
        q.data_ptr(), kv_layer.data_ptr(), num_blocks, block_size, num_kv_heads, head_dim, num_heads,
        tables.data_ptr(), tables.shape[1], lens[0].data_ptr(), lens[1].data_ptr(), lens[2].data_ptr(),
        len(query_lens), scale, out.data_ptr(),
    )  # fmt: skip
    return out
