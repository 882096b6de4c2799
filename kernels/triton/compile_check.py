"""Compile every kernel for an NVIDIA GPU without one: Triton lowers to PTX and runs the bundled
`ptxas`, so GPU-only compile errors (dot shapes, layouts, shared memory) show up on a CPU machine.

Usage: `python -m pegaserve.kernels.compile_check [--arch 90]`. Exit status 0: all compiled;
1: a kernel failed; 77: this triton cannot compile for NVIDIA here (nothing was checked).
Needs `TRITON_INTERPRET` unset: the interpreter replaces the compiler.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

SKIP_EXIT = 77

# Qwen3-0.6B's attention: 16 heads over 8 kv heads of 128, cache blocks of 16 tokens.
QWEN3_06B = dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=16)


@dataclass(frozen=True)
class CompileCase:
    name: str
    kernel: Callable
    pointers: dict[str, str]  # pointer argument -> element type ("bf16", "fp32", "i64")
    constexprs: dict[str, object]
    floats: tuple[str, ...] = ()
    num_warps: int = 4
    extra: dict[str, object] = field(default_factory=dict)


def cases() -> list[CompileCase]:
    from .block_copy import copy_blocks_kernel
    from .decode_attention import decode_merge_kernel, decode_split_kernel
    from .norm_rope import add_rms_norm_kernel, qk_norm_rope_kernel
    from .prefill_attention import prefill_attention_kernel
    from .store_kv import store_kv_kernel

    def attention_pointers(dtype: str, out: str = "out_ptr") -> dict[str, str]:
        return {"q_ptr": dtype, "cache_ptr": dtype, out: dtype, "block_tables_ptr": "i64", "context_lens_ptr": "i64"}

    decode = dict(**QWEN3_06B, BLOCK_G=16, BLOCK_N=64, BLOCK_D=128)
    prefill = dict(**QWEN3_06B, BLOCK_M=64, BLOCK_N=64, BLOCK_D=128)
    partials = {"part_out_ptr": "fp32", "part_lse_ptr": "fp32"}
    return [
        CompileCase(
            "store_kv bf16", store_kv_kernel,
            {"k_ptr": "bf16", "v_ptr": "bf16", "cache_ptr": "bf16", "slot_mapping_ptr": "i64"},
            dict(NUM_KV_HEADS=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128),
        ),
        CompileCase(
            "decode split bf16", decode_split_kernel, attention_pointers("bf16") | partials,
            dict(**decode, SPLIT=True, DOT_PRECISION="tf32"), floats=("scale_log2",),
        ),
        CompileCase(
            "decode fp32", decode_split_kernel, attention_pointers("fp32") | partials,
            dict(**decode | {"BLOCK_N": 32}, SPLIT=False, DOT_PRECISION="ieee"), floats=("scale_log2",),
        ),
        CompileCase(
            "decode merge bf16", decode_merge_kernel, {"part_out_ptr": "fp32", "part_lse_ptr": "fp32", "out_ptr": "bf16"},
            dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_S=64),
        ),
        CompileCase(
            "prefill bf16", prefill_attention_kernel, attention_pointers("bf16") | {"query_start_loc_ptr": "i64"},
            dict(**prefill, DOT_PRECISION="tf32"), floats=("scale_log2",),
        ),
        CompileCase(
            "prefill fp32", prefill_attention_kernel, attention_pointers("fp32") | {"query_start_loc_ptr": "i64"},
            dict(**prefill | {"BLOCK_M": 32, "BLOCK_N": 32}, DOT_PRECISION="ieee"), floats=("scale_log2",),
        ),
        CompileCase(
            "gather blocks bf16", copy_blocks_kernel, {"src_ptr": "bf16", "dst_ptr": "bf16", "block_ids_ptr": "i64"},
            dict(CHUNK=16 * 8 * 128, TILE=4096, GATHER=True),
        ),
        CompileCase(
            "add rms_norm bf16", add_rms_norm_kernel,
            {"x_ptr": "bf16", "residual_ptr": "bf16", "weight_ptr": "bf16", "out_ptr": "bf16", "residual_out_ptr": "bf16"},
            dict(HIDDEN=1024, BLOCK=1024, HAS_RESIDUAL=True), floats=("eps",),
        ),
        CompileCase(
            "qk norm+rope bf16", qk_norm_rope_kernel,
            {"q_ptr": "bf16", "k_ptr": "bf16", "q_out_ptr": "bf16", "k_out_ptr": "bf16", "q_weight_ptr": "bf16",
             "k_weight_ptr": "bf16", "cos_ptr": "fp32", "sin_ptr": "fp32", "positions_ptr": "i64"},
            dict(NUM_HEADS=16, NUM_KV_HEADS=8, HALF=64, BLOCK_H=16, BLOCK_KVH=8, BLOCK_HALF=64), floats=("eps",),
        ),
    ]  # fmt: skip


def compile_case(case: CompileCase, arch: int):
    """AOT-compile with the runtime's usual specialization: pointers and strides 16-divisible."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for i, name in enumerate(case.kernel.arg_names):
        if name in case.constexprs:
            signature[name] = "constexpr"
        elif name in case.pointers:
            signature[name] = "*" + case.pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in case.floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(case.kernel, signature, case.constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": case.num_warps})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80 (A100), 90 (H100/H200)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("compile_check: unset TRITON_INTERPRET (the interpreter replaces the compiler)", file=sys.stderr)
        return 1
    try:
        from triton.backends import backends
    except ImportError as e:
        print(f"compile_check: triton is not importable ({e})", file=sys.stderr)
        return SKIP_EXIT
    if "nvidia" not in backends:
        print("compile_check: this triton has no NVIDIA backend", file=sys.stderr)
        return SKIP_EXIT
    failures = 0
    for case in cases():
        start = time.perf_counter()
        try:
            compiled = compile_case(case, args.arch)
        except Exception as e:  # noqa: BLE001 - report every kernel, then fail
            failures += 1
            print(f"FAIL {case.name}: {type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}")
            continue
        ptx = compiled.asm["ptx"]
        print(
            f"ok   {case.name:20s} sm_{args.arch} {time.perf_counter() - start:5.1f}s "
            f"shared {compiled.metadata.shared:6d} B  mma {'yes' if 'mma' in ptx else 'no '}  "
            f"local-mem {'yes' if '.local' in ptx else 'no'}"
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
