"""One-shot GPU check (`make gpu-check`): kernel and device-sampling tests on CUDA, kernel microbenchmarks against
their torch references and the HBM bandwidth, and engine decode throughput on a Qwen3-0.6B-shaped
model (random bf16 weights) against transformers `generate`. Writes docs/bench/GPU.md.

Every section runs in its own try/except: a failure is recorded in the report and the next section
still runs. The whole run stays under a time budget (8 minutes on one H200 by default).

Usage: python -m benchmarks.gpu [--dry-run] [--out docs/bench/GPU.md] [--skip-tests] [--budget-s 420]
`--dry-run` needs no GPU: it runs every section's code at tiny sizes on the CPU (kernels
interpreted) and prints the report. On a borrowed device machine, `--out $OUT/GPU.md` brings the
figures back; the report is rewritten after each section, so even a killed run leaves its figures.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.gpu_engine import DRY_WORKLOAD, GPU_WORKLOAD, TINY_SHAPE, engine_throughput
from benchmarks.reports import DOCS_DIR, REPO_ROOT

if TYPE_CHECKING:  # kernel modules load late: the dry run sets up the interpreter first
    from benchmarks.kernels import AttentionShape, Timing

# Datasheet HBM bandwidths (GB/s), matched against the device name.
SPEC_PEAK_GB_S = {"H200": 4800, "H100": 3350, "H800": 3350, "A100": 2039, "L40S": 864, "A10G": 600, "L4": 300}

@dataclass
class Section:
    title: str
    lines: list[str] = field(default_factory=list)  # markdown
    error: str | None = None
    seconds: float = 0.0


@dataclass
class Check:
    """The run's state: the deadline every section checks, and the sections written so far."""

    deadline: float
    device_name: str
    out: Path | None = None  # rewritten after every section: a killed run still leaves its figures
    sections: list[Section] = field(default_factory=list)
    copy_peak_gb_s: float | None = None
    spec_peak_gb_s: float | None = None

    def run(self, title: str, body: Callable[[Section], None], min_seconds: float = 20) -> None:
        section = Section(title)
        self.sections.append(section)
        start = time.monotonic()
        if self.remaining_s() < min_seconds:
            section.error = f"skipped: {self.remaining_s():.0f} s left of the time budget"
        else:
            try:
                body(section)
            except Exception as e:  # noqa: BLE001 - record and go on to the next section
                section.error = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exc(limit=-4))
        section.seconds = time.monotonic() - start
        status = "ok" if section.error is None else "FAILED"
        print(f"[gpu-check] {title}: {status} ({section.seconds:.0f} s)", flush=True)
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(render(self))

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()


# --------------------------------------------------------------------------------------- sections


def environment(section: Section) -> None:
    import transformers
    import triton

    props = torch.cuda.get_device_properties(0)
    section.lines += [
        (
            f"- GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
            f"compute capability {props.major}.{props.minor}"
        ),
        (
            f"- torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
            f"transformers {transformers.__version__}"
        ),
    ]


def kernel_tests(check: Check, section: Section) -> None:
    tests = ["tests/kernels", "tests/engine/test_sampling_device.py"]  # every test that runs on CUDA
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    timeout_s = max(30.0, min(240.0, check.remaining_s() - 200))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False,
    )  # fmt: skip
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else "(no output)"
    section.lines.append(f"`pytest {' '.join(tests)}`: **{summary}**")
    if result.returncode != 0:
        tail = (result.stdout + result.stderr).strip().splitlines()[-40:]
        section.lines += ["", "```", *tail, "```"]
        raise RuntimeError(f"kernel tests failed (exit {result.returncode})")


def bandwidth(check: Check, section: Section) -> None:
    from benchmarks.kernels import copy_bandwidth_gb_s

    name = torch.cuda.get_device_name(0)
    check.spec_peak_gb_s = next((v for k, v in SPEC_PEAK_GB_S.items() if k in name), None)
    check.copy_peak_gb_s = copy_bandwidth_gb_s()
    spec = f"{check.spec_peak_gb_s} GB/s" if check.spec_peak_gb_s else "unknown for this GPU"
    section.lines += [
        f"- datasheet HBM peak: {spec}",
        f"- measured device-to-device copy (2 GiB, read + write): **{check.copy_peak_gb_s:.0f} GB/s** (the practical peak)",
    ]


def kernel_benchmarks(check: Check, section: Section) -> None:
    from benchmarks import kernels as bench

    timings = [bench.bench_store_kv(64), bench.bench_store_kv(8192)]
    for batch in GPU_WORKLOAD.batches:
        timings.append(bench.bench_decode([2048] * batch))
    ragged = torch.randint(1, 4097, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    timings += [bench.bench_decode(ragged), bench.bench_backends([1] * 64, [2048] * 64)]
    timings += [bench.bench_prefill([1024] * 4, [1024] * 4), bench.bench_prefill([512], [2048])]
    timings.append(bench.bench_backends([1024] * 4, [1024] * 4))
    timings += bench.bench_block_copy(num_layers=28, num_blocks=1024, num_ids=128)
    timings += bench.bench_norm_rope(64, 1024) + bench.bench_norm_rope(8192, 1024)
    section.lines += _timing_table(check, timings)
    section.lines.append(
        f"\nHost cost of one decode launcher call (checks + launch): {bench.decode_host_overhead_us():.1f} µs"
    )
    target = next(t for t in timings if t.kernel == "decode attention" and t.case == "batch 64, ctx 2048")
    section.lines.append(_target_line("paged decode attention, batch 64 x 2k context", target.gb_per_s(), check))


def decode_sweep(check: Check, section: Section) -> None:
    """Launch plans for the decode kernel at several batch shapes, each against the default plan
    (`_plan_launch`), so that a default can be chosen from one run: a summary, then each shape's
    best plans."""
    ragged = torch.randint(1, 4097, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    cases = ([2048], [2048] * 16, [2048] * 64, ragged)
    plans = list(itertools.product((32, 64, 128), (4, 8), (1, 2, 4, 8)))  # (block_n, num_warps, num_splits)
    from benchmarks.kernels import AttentionShape

    section.lines += _sweep(check, cases, plans, AttentionShape(), top=5)


def _sweep(check: Check, cases, plans, shape: AttentionShape, top: int) -> list[str]:
    from benchmarks import kernels as bench
    from pegaserve.kernels.decode_attention import _plan_launch

    summary = [
        "| case | default plan | default µs | best plan | best µs | default / best time |",
        "|---|---|---:|---|---:|---:|",
    ]
    details: list[Timing] = []
    for lens in cases:
        if check.remaining_s() < 10:
            summary.append("\n(sweep cut short by the time budget)")
            break
        chosen = _plan_launch(torch.device(shape.device), shape.dtype, len(lens), shape.num_kv_heads, max(lens),
                              None, None, None)  # fmt: skip
        default = (chosen.block_n, chosen.num_warps, chosen.num_splits)
        timings = {
            plan: bench.bench_decode(lens, shape, graphed=True, block_n=plan[0], num_warps=plan[1], num_splits=plan[2])
            for plan in dict.fromkeys([default, *plans])  # the default first, once
            if check.remaining_s() >= 5
        }
        best = min(timings, key=lambda plan: timings[plan].triton_us)
        case = timings[default].case.split(" block_n=")[0]
        summary.append(
            f"| {case} | {_plan_name(default)} | {timings[default].triton_us:.1f} | {_plan_name(best)} "
            f"| {timings[best].triton_us:.1f} | {timings[default].triton_us / timings[best].triton_us:.2f}x |"
        )
        details += sorted(timings.values(), key=lambda t: t.triton_us)[:top]
    return [
        "Device time per call, replayed as a CUDA graph: the plans' own cost, without the host's launch",
        "cost (the microbenchmarks' host cost per call, which would hide a small batch's kernel); the",
        "engine pays that cost on top until its decode steps are graphed.", "", *summary, "", f"Each case's {top} best plans:", "",
        *_timing_table(check, details),
    ]


def _plan_name(plan: tuple[int, int, int]) -> str:
    return "block_n={} num_warps={} num_splits={}".format(*plan)


# ----------------------------------------------------------------------------------------- report


def _timing_table(check: Check, timings: list[Timing]) -> list[str]:
    lines = [
        "| kernel | case | triton µs | GB/s | % datasheet | % copy peak | TFLOP/s | torch µs | torch side | speedup |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for t in timings:
        gbs = t.gb_per_s()
        cells = [
            t.kernel, t.case, f"{t.triton_us:.1f}", _fmt(gbs, "{:.0f}"),
            _fmt(gbs and check.spec_peak_gb_s and 100 * gbs / check.spec_peak_gb_s, "{:.0f}%"),
            _fmt(gbs and check.copy_peak_gb_s and 100 * gbs / check.copy_peak_gb_s, "{:.0f}%"),
            _fmt(t.tflop_per_s(), "{:.1f}"), _fmt(t.torch_us, "{:.1f}"), t.torch_what if t.torch_us else "",
            _fmt(t.speedup(), "{:.1f}x"),
        ]  # fmt: skip
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _target_line(what: str, gb_s: float | None, check: Check) -> str:
    if gb_s is None or check.spec_peak_gb_s is None:
        return f"\nTarget ({what} >= 60% of HBM peak): no datasheet peak for this GPU"
    share = gb_s / check.spec_peak_gb_s
    verdict = "met" if share >= 0.6 else "NOT met"
    return (
        f"\nTarget ({what} >= 60% of HBM peak): **{verdict}** ({100 * share:.0f}% of {check.spec_peak_gb_s:.0f} GB/s)"
    )


def _fmt(value: float | None, pattern: str) -> str:
    return "" if value is None or value is False else pattern.format(value)


def render(check: Check) -> str:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"# GPU check: {check.device_name}", "", f"Run {now} by `make gpu-check` (benchmarks/gpu.py).", ""]
    for s in check.sections:
        lines += [f"## {s.title}", "", f"_{s.seconds:.0f} s_", ""]
        lines += s.lines
        if s.error:
            lines += ["", "**Failed:**", "", "```", *s.error.strip().splitlines(), "```"]
        lines.append("")
    return "\n".join(lines)


def dry_run() -> int:
    """No GPU: run every section's code at tiny sizes on the CPU (kernels interpreted), render a report."""
    from pegaserve.kernels.testing import use_interpreter_without_cuda

    use_interpreter_without_cuda()  # before the kernel modules are imported
    print("[gpu-check] CUDA is absent: dry run at tiny sizes on the CPU (kernels interpreted)")
    check = Check(deadline=time.monotonic() + 120, device_name="none (dry run)")
    check.run("Kernel benchmarks, tiny shapes interpreted", lambda s: _tiny_kernel_benchmarks(check, s))

    check.run(
        "Engine vs transformers, tiny random model on the CPU",
        lambda s: s.lines.extend(engine_throughput(DRY_WORKLOAD, TINY_SHAPE)),
    )
    check.run("Decode launch plans, tiny shapes interpreted", lambda s: _tiny_sweep(check, s))
    check.run("Table rendering", _render_sample_table, min_seconds=0)
    print(render(check))
    return 0 if all(s.error is None for s in check.sections) else 1


def _tiny_kernel_benchmarks(check: Check, section: Section) -> None:
    from benchmarks import kernels as bench

    shape = bench.AttentionShape(
        num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, device="cpu"
    )
    timings = [
        bench.bench_store_kv(16, shape),
        bench.bench_decode([20, 9], shape),
        bench.bench_decode([20, 9], shape, block_n=16, num_warps=1, num_splits=2),
        bench.bench_backends([1, 1], [20, 9], shape),
        bench.bench_prefill([5, 9], [12, 9], shape),
        bench.bench_backends([5, 9], [12, 9], shape),
        *bench.bench_block_copy(num_layers=2, num_blocks=8, num_ids=3, shape=shape),
        *bench.bench_norm_rope(3, 48, shape),
    ]
    section.lines += _timing_table(check, timings)
    section.lines.append(f"\nHost cost of one decode launcher call: {bench.decode_host_overhead_us(2, shape):.0f} µs")


def _tiny_sweep(check: Check, section: Section) -> None:
    from benchmarks.kernels import AttentionShape

    shape = AttentionShape(num_heads=4, num_kv_heads=2, head_dim=32, block_size=8, dtype=torch.float32, device="cpu")
    section.lines += _sweep(check, ([20, 9], [33]), [(16, 1, 1), (16, 1, 2), (32, 1, 1)], shape, top=2)


def _render_sample_table(section: Section) -> None:
    from benchmarks.kernels import Timing

    sample = Timing("decode attention", "batch 64, ctx 2048", 180.0, 900.0, "reference", bytes_moved=537_000_000)
    check = Check(deadline=0.0, device_name="sample", copy_peak_gb_s=4000.0, spec_peak_gb_s=4800.0)
    section.lines += _timing_table(check, [sample])
    section.lines.append(_target_line("sample row", sample.gb_per_s(), check))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU needed: import and smoke-check only")
    parser.add_argument("--out", type=Path, default=DOCS_DIR / "GPU.md")
    parser.add_argument("--skip-tests", action="store_true", help="skip the CUDA kernel tests")
    parser.add_argument("--budget-s", type=float, default=420, help="start no section after this long")
    args = parser.parse_args(argv)
    if args.dry_run:
        return dry_run()
    if not torch.cuda.is_available():
        print("[gpu-check] CUDA is absent: nothing to measure (use --dry-run for the CPU smoke check)")
        return 2
    check = Check(deadline=time.monotonic() + args.budget_s, device_name=torch.cuda.get_device_name(0), out=args.out)
    check.run("Environment", environment, min_seconds=0)
    if not args.skip_tests:
        check.run("Tests on CUDA (kernels, device sampling)", lambda s: kernel_tests(check, s), min_seconds=60)
    check.run("Memory bandwidth", lambda s: bandwidth(check, s))
    check.run("Kernel microbenchmarks (bf16, Qwen3-0.6B attention: 16 heads, 8 kv heads, head_dim 128, blocks of 16)",
              lambda s: kernel_benchmarks(check, s), min_seconds=30)  # fmt: skip
    check.run("Engine decode throughput", lambda s: s.lines.extend(engine_throughput()), min_seconds=90)
    check.run("Decode kernel launch plans (default vs best, per batch shape)", lambda s: decode_sweep(check, s),
              min_seconds=30)  # fmt: skip
    print(render(check))
    print(f"[gpu-check] wrote {args.out}")
    return 0 if all(s.error is None for s in check.sections) else 1


if __name__ == "__main__":
    sys.exit(main())
