"""Microbenchmarks of each kernel against its torch reference, in bytes moved and FLOPs, for the
GPU check (`benchmarks/gpu.py`). Shapes default to Qwen3-0.6B's attention on CUDA.

On CUDA, timings are `triton.testing.do_bench` medians (L2 flushed between runs), in microseconds.
On the CPU (interpreted; the GPU check's dry run) they are wall times that only smoke-test the code.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pegaserve.attention.backend import AttentionBatch, AttentionSpec, SdpaBackend
from pegaserve.attention.triton import TritonBackend
from pegaserve.kernels.block_copy import (
    gather_blocks,
    gather_blocks_reference,
    scatter_blocks,
    scatter_blocks_reference,
)  # fmt: skip
from pegaserve.kernels.decode_attention import paged_decode_attention, paged_decode_attention_reference
from pegaserve.kernels.norm_rope import add_rms_norm, add_rms_norm_reference, qk_norm_rope, qk_norm_rope_reference
from pegaserve.kernels.prefill_attention import prefill_attention, prefill_attention_reference
from pegaserve.kernels.store_kv import store_kv, store_kv_reference
from pegaserve.kernels.testing import PagedBatch, make_paged_batch, noise, random_qkv


@dataclass(frozen=True)
class AttentionShape:
    """The attention a benchmark runs: Qwen3-0.6B's heads in bf16 on CUDA unless told otherwise."""

    num_heads: int = 16
    num_kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"

    @property
    def elem_bytes(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class Timing:
    kernel: str
    case: str
    triton_us: float
    torch_us: float | None  # None: the torch side was not timed
    torch_what: str  # what the torch side ran
    bytes_moved: int | None = None  # DRAM bytes the kernel must read + write at least once
    flops: int | None = None

    def gb_per_s(self) -> float | None:
        return None if self.bytes_moved is None else self.bytes_moved / self.triton_us / 1e3

    def tflop_per_s(self) -> float | None:
        return None if self.flops is None else self.flops / self.triton_us / 1e6

    def speedup(self) -> float | None:
        return None if self.torch_us is None else self.torch_us / self.triton_us


def time_us(fn: Callable[[], object], device: str, graphed: bool = False) -> float:
    """Median µs per call. On CUDA `graphed` replays the calls as a CUDA graph: the device's time
    alone, without the host's launch cost (which hides a small kernel's own time)."""
    if device == "cuda":
        import triton.testing  # noqa: PLC0415 - CUDA-only path

        if graphed:
            return triton.testing.do_bench_cudagraph(fn, rep=40, return_mode="median") * 1e3
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def copy_bandwidth_gb_s(num_bytes: int = 2 << 30) -> float:
    """The practical HBM peak: a large device-to-device copy (reads + writes `num_bytes` each)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), "cuda")
    return 2 * num_bytes / us / 1e3


def bench_store_kv(num_tokens: int, shape: AttentionShape = AttentionShape()) -> Timing:
    paged = _paged([num_tokens], [num_tokens], shape)
    _, k, v = random_qkv(num_tokens, 1, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.device)
    slots = paged.slot_mapping
    kv_bytes = 2 * k.numel() * shape.elem_bytes
    return Timing(
        "store_kv", f"{num_tokens} tokens",
        time_us(lambda: store_kv(k, v, paged.kv_layer, slots), shape.device),
        time_us(lambda: store_kv_reference(k, v, paged.kv_layer, slots), shape.device), "reference (index_put)",
        bytes_moved=2 * kv_bytes + slots.numel() * 8,
    )  # fmt: skip


def bench_decode(context_lens: list[int], shape: AttentionShape = AttentionShape(), graphed: bool = False,
                 **launch) -> Timing:
    """The kernel alone vs its fp32 torch reference; `launch` overrides the launch plan; `graphed`:
    see `time_us`."""
    paged = _paged(context_lens, [1] * len(context_lens), shape)
    q, _, _ = random_qkv(
        len(context_lens), shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.device
    )
    args = (q, paged.kv_layer, paged.block_tables, paged.context_lens, shape.head_dim**-0.5)
    max_len = max(context_lens)
    case = _lens_case(context_lens) + "".join(f" {k}={v}" for k, v in launch.items())
    return Timing(
        "decode attention", case,
        time_us(lambda: paged_decode_attention(*args, max_context_len=max_len, **launch), shape.device, graphed),
        None if launch else time_us(lambda: paged_decode_attention_reference(*args), shape.device), "reference (fp32 loop)",
        bytes_moved=_context_bytes(context_lens, shape) + 2 * q.numel() * shape.elem_bytes,
    )  # fmt: skip


def bench_backends(query_lens: list[int], context_lens: list[int], shape: AttentionShape = AttentionShape()) -> Timing:
    """A whole `backend.forward` (store + attention): triton vs sdpa, the engine's two choices."""
    paged = _paged(context_lens, query_lens, shape)
    q, k, v = random_qkv(
        sum(query_lens), shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.device
    )
    batch = AttentionBatch(
        paged.slot_mapping, paged.block_tables, paged.context_lens, paged.query_lens, paged.context_lens_cpu
    )
    spec = AttentionSpec(shape.num_heads, shape.num_kv_heads, shape.head_dim, scale=shape.head_dim**-0.5)
    triton_backend, sdpa_backend = TritonBackend(), SdpaBackend()
    phase = "decode" if batch.is_decode else "prefill"
    return Timing(
        f"{phase} backend forward", _lens_case(context_lens, query_lens),
        time_us(lambda: triton_backend.forward(q, k, v, paged.kv_layer, batch, spec), shape.device),
        time_us(lambda: sdpa_backend.forward(q, k, v, paged.kv_layer, batch, spec), shape.device), "sdpa backend",
        bytes_moved=_context_bytes(context_lens, shape) if batch.is_decode else None,
        flops=None if batch.is_decode else _attention_flops(query_lens, context_lens, shape),
    )  # fmt: skip


def bench_prefill(query_lens: list[int], context_lens: list[int], shape: AttentionShape = AttentionShape()) -> Timing:
    paged = _paged(context_lens, query_lens, shape)
    q, _, _ = random_qkv(
        sum(query_lens), shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.device
    )
    args = (q, paged.kv_layer, paged.block_tables, paged.context_lens, paged.query_start_loc, shape.head_dim**-0.5)
    return Timing(
        "prefill attention", _lens_case(context_lens, query_lens),
        time_us(lambda: prefill_attention(*args, max_query_len=max(query_lens)), shape.device),
        time_us(lambda: prefill_attention_reference(*args), shape.device), "reference (fp32 loop)",
        flops=_attention_flops(query_lens, context_lens, shape),
    )  # fmt: skip


def bench_block_copy(
    num_layers: int, num_blocks: int, num_ids: int, shape: AttentionShape = AttentionShape()
) -> list[Timing]:
    """Pack then unpack one request's `num_ids` blocks across all layers (the KV handoff)."""
    cache_shape = (num_layers, 2, num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    cache = noise(cache_shape, shape.dtype, shape.device, seed=0)
    ids = torch.randperm(num_blocks, device=shape.device)[:num_ids]
    packed = gather_blocks(cache, ids)
    moved = 2 * packed.numel() * shape.elem_bytes
    case = f"{num_layers} layers x {num_ids} blocks ({moved / 2 / 2**20:.0f} MiB)"
    return [
        Timing(
            "gather blocks", case, time_us(lambda: gather_blocks(cache, ids, out=packed), shape.device),
            time_us(lambda: gather_blocks_reference(cache, ids), shape.device), "reference (index + contiguous)", bytes_moved=moved,
        ),
        Timing(
            "scatter blocks", case, time_us(lambda: scatter_blocks(packed, cache, ids), shape.device),
            time_us(lambda: scatter_blocks_reference(packed, cache, ids), shape.device), "reference (index_put)", bytes_moved=moved,
        ),
    ]  # fmt: skip


def bench_norm_rope(num_tokens: int, hidden: int, shape: AttentionShape = AttentionShape()) -> list[Timing]:
    """The fused RMSNorm kernels vs the eager torch ops they replace (the model's own formulas)."""
    x, residual = (noise((num_tokens, hidden), shape.dtype, shape.device, seed) for seed in (0, 1))
    weight = noise((hidden,), shape.dtype, shape.device, seed=2)
    q, k, _ = random_qkv(num_tokens, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.device)
    head_weight = noise((shape.head_dim,), shape.dtype, shape.device, seed=3)
    table = noise((4096, shape.head_dim), torch.float32, shape.device, seed=4)  # stands in for cos and sin
    positions = torch.randint(0, 4096, (num_tokens,), device=shape.device)
    rope_args = (q, k, head_weight, head_weight, table, table, positions, 1e-6)
    return [
        Timing(
            "add + rms_norm", f"{num_tokens} x {hidden}",
            time_us(lambda: add_rms_norm(x, weight, 1e-6, residual), shape.device),
            time_us(lambda: add_rms_norm_reference(x, weight, 1e-6, residual), shape.device), "eager torch",
            bytes_moved=4 * x.numel() * shape.elem_bytes,
        ),
        Timing(
            "q/k rms_norm + rope", f"{num_tokens} tokens",
            time_us(lambda: qk_norm_rope(*rope_args), shape.device),
            time_us(lambda: qk_norm_rope_reference(*rope_args), shape.device), "eager torch",
            bytes_moved=2 * (q.numel() + k.numel()) * shape.elem_bytes,
        ),
    ]  # fmt: skip


def decode_host_overhead_us(num_calls: int = 200, shape: AttentionShape = AttentionShape()) -> float:
    """Wall time per launcher call on a tiny batch: the host-side cost (checks + launch)."""
    paged = _paged([16], [1], shape)
    q, _, _ = random_qkv(1, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.dtype, shape.device)
    args = (q, paged.kv_layer, paged.block_tables, paged.context_lens, 0.1)
    paged_decode_attention(*args, max_context_len=16)
    _sync(shape.device)
    start = time.perf_counter()
    for _ in range(num_calls):
        paged_decode_attention(*args, max_context_len=16)
    _sync(shape.device)
    return (time.perf_counter() - start) / num_calls * 1e6


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _paged(context_lens: list[int], query_lens: list[int], shape: AttentionShape) -> PagedBatch:
    return make_paged_batch(
        context_lens, query_lens, block_size=shape.block_size, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, dtype=shape.dtype, device=shape.device,
    )  # fmt: skip


def _context_bytes(context_lens: list[int], shape: AttentionShape) -> int:
    """K and V of every context token, read once."""
    return 2 * sum(context_lens) * shape.num_kv_heads * shape.head_dim * shape.elem_bytes


def _attention_flops(query_lens: list[int], context_lens: list[int], shape: AttentionShape) -> int:
    """2 matmuls x 2 FLOPs per multiply-add over the causally visible (query, key) pairs."""
    pairs = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(query_lens, context_lens))
    return 4 * pairs * shape.num_heads * shape.head_dim


def _lens_case(context_lens: list[int], query_lens: list[int] | None = None) -> str:
    n = len(context_lens)
    ctx = f"ctx {context_lens[0]}" if len(set(context_lens)) == 1 else f"ctx {min(context_lens)}-{max(context_lens)}"
    if query_lens is None or all(q == 1 for q in query_lens):
        return f"batch {n}, {ctx}"
    new = f"new {query_lens[0]}" if len(set(query_lens)) == 1 else f"new {min(query_lens)}-{max(query_lens)}"
    return f"batch {n}, {new}, {ctx}"
