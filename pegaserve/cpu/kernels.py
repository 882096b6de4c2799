"""The engine's CPU kernels (`csrc/*.cpp`): compiled on first use with the system C++ compiler, in
about a second each, for the widest instruction set this CPU has of AVX-512 F/BW/VL and AVX2 + FMA +
F16C (`csrc/simd.h` words them for both), and loaded with ctypes (which releases the GIL during a call).

They are plain C ABI: no torch headers, no ninja. They build with -fopenmp, and their threads are
torch's OpenMP pool: the libgomp torch loaded, which the process resolves theirs to. A build lives in
`~/.cache/pegaserve/<name>/<hash of source, compiler and flags>/`; each build writes a private file
and renames it into place, so processes starting together (engine cores, test workers) never load a
half-written library. Where the CPU has neither instruction set, no compiler is found or the build
fails, `load` answers None (logged once per kernel) and the caller uses its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
ISA_FLAGS = {  # instruction set -> what the compiler is told; the first this CPU has is used
    "avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mfma"),
    "avx2": ("-mavx2", "-mfma", "-mf16c"),
}
ISA_NAMES = {"avx512": "AVX-512", "avx2": "AVX2"}
_ISA_CPU_FLAGS = {"avx512": ("avx512_f", "avx512_bw", "avx512_vl", "fma3"), "avx2": ("avx2", "fma3", "f16c")}
_TORCH_LEVELS = {"avx512": ("AVX512",), "avx2": ("AVX512", "AVX2")}
CXX_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-pthread", "-fopenmp")
BUILD_TIMEOUT_S = 120.0


@functools.cache
def runnable_isas() -> tuple[str, ...]:
    """The instruction sets of `ISA_FLAGS` this CPU runs, widest first, from cpuinfo."""
    capabilities = getattr(torch.cpu, "get_capabilities", None)
    if capabilities is None:  # torch < 2.9: its dispatch level (AVX512 needs F/BW/VL/DQ)
        level = torch.backends.cpu.get_cpu_capability()
        return tuple(name for name in ISA_FLAGS if level.startswith(_TORCH_LEVELS[name]))
    found = capabilities()
    return tuple(name for name in ISA_FLAGS if all(found.get(flag, False) for flag in _ISA_CPU_FLAGS[name]))


def isa() -> str | None:
    """The instruction set the kernels are built for here ("avx512", "avx2"): the widest this CPU
    runs; None where it has neither (the torch paths run)."""
    return next(iter(runnable_isas()), None)


def build(name: str, build_root: Path | None = None, target_isa: str | None = None) -> Path:
    """The shared library of `csrc/<name>.cpp` for `target_isa` (default: this CPU's), compiled
    unless a build of the same source and flags exists under `build_root` (default
    ~/.cache/pegaserve/<name>)."""
    target_isa = target_isa or isa()
    if target_isa not in ISA_FLAGS:
        raise RuntimeError(f"no instruction set to build for (this CPU has neither {' nor '.join(ISA_FLAGS)})")
    flags = (*CXX_FLAGS, *ISA_FLAGS[target_isa])
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError("no C++ compiler (c++, g++ or clang++) on PATH")
    source_path = CSRC / f"{name}.cpp"
    sources = [source_path.read_bytes(), *(h.read_bytes() for h in sorted(CSRC.glob("*.h")))]
    key = b"\0".join([*sources, compiler.encode(), platform.machine().encode(), *map(str.encode, flags)])
    build_root = build_root or Path.home() / ".cache" / "pegaserve" / name
    target = build_root / hashlib.sha256(key).hexdigest()[:16] / f"{name}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *flags, str(source_path), "-o", partial], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def load(name: str, label: str, fallback: str, declare: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """`csrc/<name>.cpp` built and loaded, its functions typed by `declare`; None where it cannot
    run, logged with the kernel's `label` and the `fallback` used instead."""
    if isa() is None:
        log.info("%s: this CPU has neither AVX-512 nor AVX2 with FMA and F16C; using %s", label, fallback)
        return None
    try:
        library = ctypes.CDLL(str(build(name)))
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        log.warning("%s: the %s kernel did not build (%s); using %s", label, ISA_NAMES[isa()], error, fallback)
        return None
    declare(library)
    return library


def _declare_void(library: ctypes.CDLL, signatures: tuple[tuple[str, list], ...]) -> None:
    """Types each (function, argument types) of `signatures` in `library` as returning nothing."""
    for function, argtypes in signatures:
        getattr(library, function).restype = None
        getattr(library, function).argtypes = argtypes


@functools.cache
def vocab_passes() -> ctypes.CDLL | None:
    """`csrc/vocab_passes.cpp`: the sampler's passes over a row of logits."""

    def declare(library: ctypes.CDLL) -> None:
        i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
        _declare_void(library, (
            ("pegaserve_max_argmax", [ptr, i64, i64, ptr, i64, ptr, ptr]),
            ("pegaserve_cell_masses", [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, f32, i64, ptr]),
            ("pegaserve_top_p_bound", [ptr, i64, i64, ptr, i64, ptr, ptr, ptr, f32, ptr, i64, ptr]),
        ))  # fmt: skip

    return load("vocab_passes", "Sampler passes", "torch's ops", declare)


@functools.cache
def lm_head() -> ctypes.CDLL | None:
    """`csrc/lm_head.cpp`: the LM head and its screened reads (`lm_head.CpuLogits`, `lm_head.ScreenedHead`)."""

    def declare(library: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        library.pegaserve_lm_head_group_cols.restype = ctypes.c_int
        library.pegaserve_lm_head_group_cols.argtypes = []
        _declare_void(library, (
            ("pegaserve_lm_head", [ptr, i64, i64, ptr, i64, ptr, i64]),
            ("pegaserve_lm_head_argmax", [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, i64]),
            ("pegaserve_lm_head_upper", [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_float, i64, ptr, ptr, ptr, i64]),
            ("pegaserve_lm_head_logits_at", [ptr, i64, i64, ptr, ptr, ptr]),
        ))  # fmt: skip

    return load("lm_head", "LM head", "oneDNN's linear", declare)


@functools.cache
def paged_attention() -> ctypes.CDLL | None:
    """`csrc/paged_attention.cpp`: attention of a few queries per request over the paged cache."""

    def declare(library: ctypes.CDLL) -> None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        library.pegaserve_paged_attention_max_head_dim.restype = ctypes.c_int
        library.pegaserve_paged_attention_max_head_dim.argtypes = []
        library.pegaserve_paged_attention.restype = None
        library.pegaserve_paged_attention.argtypes = [ptr, ptr, i64, i64, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64,
                                                      ctypes.c_float, ptr]

    return load("paged_attention", "Paged attention", "torch's SDPA", declare)
