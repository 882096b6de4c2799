"""Helpers for the kernel tests and the GPU check: interpreter set-up and random paged batches.

Importing this module imports neither triton nor a kernel module, so a test can call
`use_interpreter_without_cuda()` first and import the kernels after it.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

import torch


def use_interpreter_without_cuda() -> None:
    """Without CUDA, run kernels in Triton's interpreter. Must precede the first kernel import:
    `@triton.jit` picks compile or interpret when the decorated module is imported.

    In a pytest session triton is often imported earlier, in compile mode, by something else
    (transformers imports torch._dynamo, which imports triton.language). Then triton's own
    `@jit` library functions (`tl.zeros`, `tl.max`, `tl.sum`, ...) were built for the compiler and
    an interpreted kernel cannot call them; they are re-wrapped for the interpreter here. That
    only happens on a machine without CUDA, where nothing can compile a Triton kernel anyway.
    Setting TRITON_INTERPRET=1 before anything imports triton (e.g. in tests/conftest.py) makes
    this a no-op.
    """
    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "1") != "1":
        return
    os.environ["TRITON_INTERPRET"] = "1"
    if "triton.language" in sys.modules:
        _rewrap_triton_language_for_interpreter()


def _rewrap_triton_language_for_interpreter() -> None:
    """Replace the compile-mode `JITFunction`s of triton.language (modules and tensor methods)
    with `InterpretedFunction`s of the same Python functions, as an interpret-mode import makes."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    tl = sys.modules["triton.language"]
    namespaces = [m for name, m in list(sys.modules.items()) if name.startswith("triton.language") and m is not None]
    for namespace in [*namespaces, tl.tensor]:
        for name, value in list(vars(namespace).items()):
            if isinstance(value, JITFunction):
                setattr(namespace, name, InterpretedFunction(value.fn))


def kernel_devices() -> list[str]:
    """The devices kernel tests run on: the GPU when there is one, else the CPU (interpreted)."""
    return ["cuda"] if torch.cuda.is_available() else ["cpu"]


def kernels_unavailable_reason() -> str | None:
    """Why the kernels cannot run in this process, or None when they can."""
    try:
        importlib.import_module("triton")
    except ImportError as e:
        return f"triton is not installed ({e}); it is in the `test` extra"
    if torch.cuda.is_available():
        return None
    if os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "no CUDA and TRITON_INTERPRET is not 1"
    from triton.runtime.interpreter import InterpretedFunction

    store_kv = importlib.import_module("pegaserve.kernels.store_kv")
    if not isinstance(store_kv.store_kv_kernel, InterpretedFunction):
        return "pegaserve.kernels was imported before TRITON_INTERPRET=1 was set"
    if not isinstance(importlib.import_module("triton.language").zeros, InterpretedFunction):
        return "triton.language was imported in compile mode; set TRITON_INTERPRET=1 before anything imports triton"
    return None


@dataclass(frozen=True)
class PagedBatch:
    """A random paged context: `kv_layer` full of noise, each request's blocks scattered across it
    in random order with unused blocks between them (holes), tables padded with 0."""

    kv_layer: torch.Tensor  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64
    context_lens: torch.Tensor  # [num_reqs] int64
    query_lens: tuple[int, ...]
    context_lens_cpu: tuple[int, ...]

    @property
    def query_start_loc(self) -> torch.Tensor:
        lens = torch.tensor((0, *self.query_lens), dtype=torch.int64)
        return lens.cumsum(0).to(self.kv_layer.device)  # [num_reqs + 1]

    @property
    def slot_mapping(self) -> torch.Tensor:
        """Slots of each request's last `query_lens[i]` positions: where this step's K/V go."""
        block_size = self.kv_layer.shape[2]
        tables = self.block_tables.cpu()
        slots = [
            int(tables[i, pos // block_size]) * block_size + pos % block_size
            for i, (q_len, ctx_len) in enumerate(zip(self.query_lens, self.context_lens_cpu))
            for pos in range(ctx_len - q_len, ctx_len)
        ]
        return torch.tensor(slots, dtype=torch.int64, device=self.kv_layer.device)


def make_paged_batch(
    context_lens: list[int],
    query_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    spare_blocks: int = 3,
    seed: int = 0,
) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_req) + spare_blocks + 1
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 only ever pads
    max_blocks = max(blocks_per_req)
    rows, start = [], 0
    for n in blocks_per_req:
        rows.append(ids[start : start + n] + [0] * (max_blocks - n))
        start += n
    kv_layer = noise((2, num_blocks, block_size, num_kv_heads, head_dim), dtype, device, seed)
    return PagedBatch(
        kv_layer=kv_layer,
        block_tables=torch.tensor(rows, dtype=torch.int64, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int64, device=device),
        query_lens=tuple(query_lens),
        context_lens_cpu=tuple(context_lens),
    )


def random_qkv(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k and v [T, KVH, D]."""
    q = noise((num_tokens, num_heads, head_dim), dtype, device, seed)
    k = noise((num_tokens, num_kv_heads, head_dim), dtype, device, seed + 1)
    v = noise((num_tokens, num_kv_heads, head_dim), dtype, device, seed + 2)
    return q, k, v


def noise(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    """Seeded N(0, 1), drawn on `device` itself (a GPU-sized cache would take seconds on the CPU)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=device).to(dtype)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """`assert_close` tolerances against an fp32 reference: half types round P before P @ V."""
    return {
        torch.float32: {"atol": 1e-4, "rtol": 1e-4},
        torch.float16: {"atol": 5e-3, "rtol": 5e-3},
        torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2},
    }[dtype]


def kernel_dtypes(device: str) -> list[torch.dtype]:
    """fp32 everywhere; the half types only on CUDA (the interpreter's bf16 is emulated and slow)."""
    return [torch.float32, torch.float16, torch.bfloat16] if device == "cuda" else [torch.float32]
