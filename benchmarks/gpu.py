"""One-shot GPU check (`make gpu-check`): kernel tests on CUDA, kernel microbenchmarks against
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
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from benchmarks.reports import DOCS_DIR, REPO_ROOT
from pegaserve.engine.build import load_engine
from pegaserve.engine.engine import EngineConfig
from pegaserve.engine.request import EngineRequest, SamplingParams
from pegaserve.stop import StopPolicy

if TYPE_CHECKING:  # kernel modules load late: the dry run sets up the interpreter first
    from benchmarks.kernels import Timing

# Datasheet HBM bandwidths (GB/s), matched against the device name.
SPEC_PEAK_GB_S = {"H200": 4800, "H100": 3350, "H800": 3350, "A100": 2039, "L40S": 864, "A10G": 600, "L4": 300}
QWEN3_06B_SHAPE = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    intermediate_size=3072, vocab_size=151936,
)  # fmt: skip
TINY_SHAPE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    intermediate_size=128, vocab_size=1024,
)  # fmt: skip


@dataclass(frozen=True)
class Workload:
    """Engine vs transformers decode: `batches` of random prompts, greedy, EOS ignored."""

    batches: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int
    device: str
    dtype: torch.dtype
    warmup: tuple[int, int, int]  # (batch, prompt, new tokens) run first, to compile the kernels


# the warm-up's contexts run from 32 to 80 tokens: both decode variants (one split, several) compile
GPU_WORKLOAD = Workload((1, 16, 64), 128, 128, device="cuda", dtype=torch.bfloat16, warmup=(4, 32, 48))
DRY_WORKLOAD = Workload((1, 2), 8, 4, device="cpu", dtype=torch.float32, warmup=(1, 4, 2))


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
    tests = ["tests/kernels"]
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
    """Launch plans for the decode kernel at batch 64 x 2k, to tune its defaults."""
    from benchmarks import kernels as bench

    timings = [bench.bench_decode([2048] * 64)]  # the default plan first
    for block_n, num_warps, num_splits in itertools.product((32, 64, 128), (4, 8), (1, 2, 4, 8)):
        if check.remaining_s() < 10:
            section.lines.append("(sweep cut short by the time budget)\n")
            break
        timings.append(bench.bench_decode([2048] * 64, block_n=block_n, num_warps=num_warps, num_splits=num_splits))
    section.lines += _timing_table(check, sorted(timings, key=lambda t: t.triton_us))


def engine_throughput(section: Section, workload: Workload = GPU_WORKLOAD, shape: dict = QWEN3_06B_SHAPE) -> None:
    backends = ("triton", "sdpa")  # on the CPU (dry run) triton runs interpreted
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_qwen3(Path(tmp), shape, workload.dtype, workload.device)
        rates = {backend: _engine_rates(model_dir, backend, workload) for backend in backends}
        rates["transformers"] = _transformers_rates(model_dir, workload)
    dtype_name = str(workload.dtype).removeprefix("torch.")
    columns = [f"{'' if name == 'transformers' else 'engine '}{name} tok/s" for name in rates]
    section.lines += [
        (
            f"Decode tokens/s after a {workload.prompt_tokens}-token prompt, {workload.new_tokens} greedy tokens "
            f"per request (prefill excluded; random {dtype_name} weights, {shape['num_hidden_layers']} layers, "
            f"hidden {shape['hidden_size']})."
        ),
        "",
        "| batch | " + " | ".join(columns) + " | engine / transformers |",
        "|---:|" + "---:|" * (len(rates) + 1),
    ]
    for batch in workload.batches:
        ratio = rates[backends[0]][batch] / rates["transformers"][batch]
        cells = [f"{rates[name][batch]:.0f}" for name in rates]
        section.lines.append(f"| {batch} | " + " | ".join(cells) + f" | **{ratio:.2f}x** |")
    biggest = workload.batches[-1]
    ratio = rates[backends[0]][biggest] / rates["transformers"][biggest]
    verdict = "met" if ratio >= 3 else "NOT met"
    section.lines.append(f"\nTarget: batch {biggest} at least 3x transformers: **{verdict}** ({ratio:.2f}x)")
    section.lines.append(_sampling_cost_line(biggest, shape["vocab_size"], workload.device))


# ----------------------------------------------------------------------------------------- engine


def write_random_qwen3(out_dir: Path, shape: dict, dtype: torch.dtype, device: str) -> Path:
    """A Hugging Face Qwen3 directory (config.json + model.safetensors, tied embeddings) with
    random weights drawn on `device`. No tokenizer: the engine takes token ids."""
    from safetensors.torch import save_file

    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **shape,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
        "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": True,
        "attention_bias": False, "attention_dropout": 0.0, "use_cache": True,
        "sliding_window": None, "use_sliding_window": False, "max_window_layers": shape["num_hidden_layers"],
        "bos_token_id": min(151643, shape["vocab_size"] - 1), "eos_token_id": min(151645, shape["vocab_size"] - 1),
        "dtype": str(dtype).removeprefix("torch."), "torch_dtype": str(dtype).removeprefix("torch."),
    }  # fmt: skip
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for name, dims in _parameter_shapes(shape).items():
        if len(dims) == 1:
            weights[name] = torch.ones(dims, dtype=dtype)
        else:
            std = 1.0 if "embed_tokens" in name else dims[1] ** -0.5
            weights[name] = (torch.randn(dims, generator=gen, device=device) * std).to(dtype).cpu()
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def _parameter_shapes(s: dict) -> dict[str, tuple[int, ...]]:
    hidden, inter, hd = s["hidden_size"], s["intermediate_size"], s["head_dim"]
    q_dim, kv_dim = s["num_attention_heads"] * hd, s["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (s["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes |= {
            f"{p}.input_layernorm.weight": (hidden,), f"{p}.post_attention_layernorm.weight": (hidden,),
            f"{p}.self_attn.q_proj.weight": (q_dim, hidden), f"{p}.self_attn.k_proj.weight": (kv_dim, hidden),
            f"{p}.self_attn.v_proj.weight": (kv_dim, hidden), f"{p}.self_attn.o_proj.weight": (hidden, q_dim),
            f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,),
            f"{p}.mlp.gate_proj.weight": (inter, hidden), f"{p}.mlp.up_proj.weight": (inter, hidden),
            f"{p}.mlp.down_proj.weight": (hidden, inter),
        }  # fmt: skip
    return shapes


def decode_tokens_per_s(engine, batch: int, prompt_tokens: int, new_tokens: int, tag: str) -> float:
    """Greedy-decode `batch` random prompts; tokens/s from the step after every request's first
    token (prefill done) until all finish."""
    gen = torch.Generator().manual_seed(batch)
    vocab_size = engine.model_config.vocab_size
    for i in range(batch):
        prompt = torch.randint(0, vocab_size, (prompt_tokens,), generator=gen).tolist()
        policy = StopPolicy(max_tokens=new_tokens + 1, ignore_eos=True)
        engine.add_request(EngineRequest(f"{tag}-{batch}-{i}", tuple(prompt), SamplingParams(temperature=0.0), policy))
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in engine.step()}
    start, num_tokens = time.perf_counter(), 0
    while engine.has_work():
        num_tokens += sum(len(o.tokens) for o in engine.step())
    return num_tokens / (time.perf_counter() - start)


def _engine_rates(model_dir: Path, backend: str, workload: Workload) -> dict[int, float]:
    config = EngineConfig(
        block_size=16,
        num_blocks=2048,
        max_num_seqs=max(workload.batches),
        max_num_batched_tokens=8192,
        max_model_len=4096,
    )
    engine = load_engine(model_dir, config, attention_backend=backend, device=workload.device, dtype=workload.dtype)
    decode_tokens_per_s(engine, *workload.warmup, f"warmup-{backend}")
    rates = {
        batch: decode_tokens_per_s(engine, batch, workload.prompt_tokens, workload.new_tokens, backend)
        for batch in workload.batches
    }
    del engine
    _empty_cache(workload.device)
    return rates


def _transformers_rates(model_dir: Path, workload: Workload) -> dict[int, float]:
    """generate() decode tokens/s: (time for N tokens - time for 1) covers N - 1 decode steps."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=workload.dtype).to(workload.device).eval()
    n = workload.new_tokens
    with torch.inference_mode():
        _generate_s(model, workload, 2, 4)  # warm-up
        rates = {
            b: b * (n - 1) / (_generate_s(model, workload, b, n) - _generate_s(model, workload, b, 1))
            for b in workload.batches
        }
    del model
    _empty_cache(workload.device)
    return rates


def _generate_s(model, workload: Workload, batch: int, new_tokens: int) -> float:
    """Seconds for one greedy `generate` of exactly `new_tokens` tokens per random prompt."""
    ids = torch.randint(0, model.config.vocab_size, (batch, workload.prompt_tokens), device=workload.device)
    _sync(workload.device)
    start = time.perf_counter()
    model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0,
    )  # fmt: skip
    _sync(workload.device)
    return time.perf_counter() - start


def _sampling_cost_line(batch: int, vocab_size: int, device: str) -> str:
    """Where an engine step's host time goes besides the model: logits to the CPU and sampling."""
    from pegaserve.engine.sampler import SamplingRow, sample

    logits = torch.randn(batch, vocab_size, device=device)
    rows = [SamplingRow(SamplingParams(temperature=0.0), 0, frozenset())] * batch
    _sync(device)
    start = time.perf_counter()
    cpu_logits = logits.cpu()
    copied = time.perf_counter()
    sample(cpu_logits, rows)
    done = time.perf_counter()
    return (
        f"\nPer engine step at batch {batch}, outside the model: logits to the CPU {1e3 * (copied - start):.1f} ms, "
        f"greedy `sample()` on the CPU {1e3 * (done - copied):.1f} ms."
    )


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _empty_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()


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
    from pegaserve_kernels.testing import use_interpreter_without_cuda

    use_interpreter_without_cuda()  # before the kernel modules are imported
    print("[gpu-check] CUDA is absent: dry run at tiny sizes on the CPU (kernels interpreted)")
    check = Check(deadline=time.monotonic() + 120, device_name="none (dry run)")
    check.run("Kernel benchmarks, tiny shapes interpreted", lambda s: _tiny_kernel_benchmarks(check, s))

    check.run(
        "Engine vs transformers, tiny random model on the CPU", lambda s: engine_throughput(s, DRY_WORKLOAD, TINY_SHAPE)
    )
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
        check.run("Kernel tests on CUDA", lambda s: kernel_tests(check, s), min_seconds=60)
    check.run("Memory bandwidth", lambda s: bandwidth(check, s))
    check.run("Kernel microbenchmarks (bf16, Qwen3-0.6B attention: 16 heads, 8 kv heads, head_dim 128, blocks of 16)",
              lambda s: kernel_benchmarks(check, s), min_seconds=30)  # fmt: skip
    check.run("Engine decode throughput", engine_throughput, min_seconds=90)
    check.run("Decode kernel launch plans (batch 64 x 2k)", lambda s: decode_sweep(check, s), min_seconds=30)
    print(render(check))
    print(f"[gpu-check] wrote {args.out}")
    return 0 if all(s.error is None for s in check.sections) else 1


if __name__ == "__main__":
    sys.exit(main())
