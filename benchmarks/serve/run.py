"""`make bench`: pegaserve P/D and colocated over HTTP against transformers `generate` offline.

The same deterministic prompts (16-128 tokens, `benchmarks.engine.make_prompts`), 64 new
tokens each, greedy, EOS ignored, at concurrency 1, 4, 16 and 32 (max(8, 2 x concurrency)
requests per level). pegaserve is driven by the official `openai` client with `stream=True`;
transformers runs batch = concurrency in this process. Each level also records where the CPU went
(`benchmarks.cpu`), and the P/D app's ledger says how long each request spent in each phase.

By default Ray and Serve are started in this process on 127.0.0.1 and both apps are deployed one
after the other; `--url` benchmarks an already running server instead (e.g. `make serve`).
Writes docs/bench/RESULTS.md, and benchmarks/results/results.json, throughput.png and latency.png.

    python -m benchmarks.serve [--url http://127.0.0.1:8000] [--systems pd,colocated,transformers]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlsplit

from benchmarks.cpu import CpuMeter, CpuUsage, QuietGate
from benchmarks.reports import DOCS_DIR, RESULTS_DIR
from benchmarks.serve.client import LevelRun, read_ledger, run_level, warm_up
from benchmarks.serve.stats import LevelSummary, Slo, summarize

LEVELS = (1, 4, 16, 32)
MAX_TOKENS = 64
LEVEL_BUDGET_S = 45.0  # no request starts later than this into a level; in-flight ones finish
CONTENDED_CORES = 0.5  # a level during which other processes used more is measured again, once
PROFILE_LEVEL = 16  # the target's level: its ledger records and engine-only ceiling are kept
MODEL = "qwen3-tiny"
SYSTEMS = ("transformers", "pd", "colocated")
SYSTEM_NAMES = {
    "pd": "pegaserve P/D (shm)",
    "colocated": "pegaserve colocated",
    "transformers": "transformers generate (offline)",
    "url": "pegaserve at --url",
}
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
T = TypeVar("T")


def num_requests(concurrency: int) -> int:
    return max(8, 2 * concurrency)


@dataclasses.dataclass
class SystemResult:
    key: str
    levels: list[LevelSummary] = dataclasses.field(default_factory=list)
    cpu: dict[int, CpuUsage] = dataclasses.field(default_factory=dict)
    ledger: list[dict] = dataclasses.field(default_factory=list)  # PROFILE_LEVEL's records
    client_offset_s: float = 0.0  # time.time() - time.perf_counter(), to line up with the ledger
    profile_timings: list[dict] = dataclasses.field(default_factory=list)
    setup_s: float = 0.0
    quiet_wait_s: dict[int, float] = dataclasses.field(default_factory=dict)  # waited for neighbours to quiet


def _load_1m() -> float:
    return os.getloadavg()[0]


# --- pegaserve over HTTP --------------------------------------------------------------------------


def measure_level(gate: QuietGate, run: Callable[[], tuple[T, float]]) -> tuple[T, CpuUsage, float]:
    """`run()` -> (what it produced, wall seconds), once the machine is quiet; run again, once, when
    other processes took more than `CONTENDED_CORES` meanwhile. Returns (produced, CPU, waited s)."""
    meter = CpuMeter()
    waited = 0.0
    for attempt in range(2):
        waited += gate.wait()
        meter.start()
        produced, wall_s = run()
        cpu = meter.stop(wall_s)
        others_cores = cpu.others_s / wall_s if wall_s > 0 else 0.0
        if others_cores <= CONTENDED_CORES or attempt == 1:
            return produced, cpu, waited
        print(f"  (other processes used {others_cores:.2f} cores meanwhile: measuring the level again)", flush=True)
    raise AssertionError("unreachable")


def bench_http(key: str, url: str, prompts: list[list[int]], levels: tuple[int, ...], slo: Slo,
               budget_s: float, gate: QuietGate) -> SystemResult:
    result = SystemResult(key, client_offset_s=time.time() - time.perf_counter())
    asyncio.run(warm_up(url, MODEL, prompts[:4], MAX_TOKENS))
    for concurrency in levels:
        batch = prompts[: num_requests(concurrency)]

        def run(concurrency=concurrency, batch=batch) -> tuple[LevelRun, float]:
            level = asyncio.run(run_level(url, MODEL, batch, MAX_TOKENS, concurrency, budget_s))
            return level, level.wall_s

        level, result.cpu[concurrency], result.quiet_wait_s[concurrency] = measure_level(gate, run)
        summary = summarize(SYSTEM_NAMES[key], concurrency, level.timings, level.wall_s, slo, level.client_cpu_s,
                            _load_1m())  # fmt: skip
        result.levels.append(summary)
        _print_level(summary)
        if concurrency == PROFILE_LEVEL:
            ids = [t.request_id for t in level.timings if t.request_id]
            result.ledger = asyncio.run(read_ledger(url, ids))
            result.profile_timings = [
                {"request_id": t.request_id, "start_s": t.start_s, "first_s": t.chunk_times_s[0], "end_s": t.end_s}
                for t in level.timings if t.ok
            ]  # fmt: skip
    return result


def bench_local_serve(keys: list[str], prompts, levels, slo: Slo, budget_s: float, gate: QuietGate,
                      engine_threads: int | None, stream_interval: int = 1) -> list[SystemResult]:
    from benchmarks.local_serve import LocalServe  # noqa: PLC0415

    results = []
    with LocalServe() as local:
        for key in keys:
            start = time.perf_counter()
            args = {"model": MODEL, "mode": "colocated" if key == "colocated" else "pd", "transport": "shm",
                    "ledger_journal": None, "stream_interval": stream_interval,
                    "engine": {"torch_threads": engine_threads or 1}}
            url = local.deploy(key, args)
            setup_s = time.perf_counter() - start
            print(f"{SYSTEM_NAMES[key]}: deployed at {url} in {setup_s:.0f}s", flush=True)
            result = bench_http(key, url, prompts, levels, slo, budget_s, gate)
            result.setup_s = setup_s
            results.append(result)
            local.delete(key)
    return results


# --- transformers and the engine alone -------------------------------------------------------------


def bench_transformers(model_dir: Path, prompts, levels, slo: Slo, budget_s: float, gate: QuietGate) -> SystemResult:
    from benchmarks.serve.reference import Reference  # noqa: PLC0415

    result = SystemResult("transformers")
    start = time.perf_counter()
    reference = Reference(model_dir, MAX_TOKENS)
    reference.generate(prompts[:4])  # warm-up
    result.setup_s = time.perf_counter() - start
    for concurrency in levels:
        batch = prompts[: num_requests(concurrency)]

        def run(concurrency=concurrency, batch=batch) -> tuple[tuple[list, float], float]:
            timings, wall_s = reference.run_level(batch, concurrency, budget_s)
            return (timings, wall_s), wall_s

        (timings, wall_s), result.cpu[concurrency], result.quiet_wait_s[concurrency] = measure_level(gate, run)
        summary = summarize(SYSTEM_NAMES["transformers"], concurrency, timings, wall_s, slo, None, _load_1m())
        result.levels.append(summary)
        _print_level(summary)
    return result


def bench_engine_alone(model_dir: Path, prompts: list[list[int]], max_num_seqs: int) -> dict:
    """pegaserve's engine in this process, one torch thread (as in a replica), all requests added
    at once and stepped to the end: the ceiling the HTTP path is measured against."""
    import torch  # noqa: PLC0415

    from benchmarks.engine import make_engine, run_engine  # noqa: PLC0415

    engine = make_engine(model_dir, max_num_seqs, num_blocks=1024)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_engine(engine, prompts[:4], "warm-up", MAX_TOKENS)
        seconds, tokens = run_engine(engine, prompts, "timed", MAX_TOKENS)
    finally:
        torch.set_num_threads(threads)
    num_tokens = sum(len(t) for t in tokens)
    print(f"engine alone, 1 thread, {len(prompts)} requests, max_num_seqs {max_num_seqs}: "
          f"{num_tokens / seconds:.1f} tok/s", flush=True)  # fmt: skip
    return {"num_requests": len(prompts), "max_num_seqs": max_num_seqs, "threads": 1, "seconds": seconds,
            "output_tokens_per_s": num_tokens / seconds}


# --- the run ----------------------------------------------------------------------------------------


def _print_level(s: LevelSummary) -> None:
    print(f"  {s.system:<32} c={s.concurrency:<3} {s.num_requests - s.num_failed}/{s.num_requests} ok "
          f"{s.output_tokens_per_s:7.1f} tok/s  "
          f"TTFT p50 {s.ttft_p50_s * 1e3:6.0f} ms p99 {s.ttft_p99_s * 1e3:6.0f} ms  "
          f"ITL p50 {s.itl_p50_s * 1e3:5.0f} ms p99 {s.itl_p99_s * 1e3:5.0f} ms  goodput {s.goodput_rps:.2f} req/s  "
          f"wall {s.wall_s:.1f}s load {s.load_avg_1m:.1f}", flush=True)  # fmt: skip


def _check_local(url: str) -> str:
    host = urlsplit(url).hostname
    if host not in LOCAL_HOSTS:
        raise SystemExit(f"--url must point at this machine (127.0.0.1 / localhost), not {host!r}")
    return url.rstrip("/")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {SYSTEMS}")
    parser.add_argument("--levels", default=",".join(map(str, LEVELS)), help="concurrency levels")
    parser.add_argument("--level-budget-s", type=float, default=LEVEL_BUDGET_S)
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="torch threads per engine replica (default: Ray's 1 for 0.5 CPU, as `make serve`)")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the apps' stream_interval: tokens per decode->ingress message and per SSE chunk")
    parser.add_argument("--out", type=Path, default=DOCS_DIR, help="where RESULTS.md goes")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where results.json and the plots go")
    args = parser.parse_args(argv)

    from benchmarks.engine import make_prompts  # noqa: PLC0415
    from benchmarks.serve.report import write_report  # noqa: PLC0415
    from pegaserve.models.tiny import build_default_model  # noqa: PLC0415

    levels = tuple(int(c) for c in args.levels.split(","))
    keys = [k.strip() for k in args.systems.split(",") if k.strip()]
    unknown = set(keys) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    slo = Slo()
    gate = QuietGate()
    model_dir = build_default_model()
    prompts = make_prompts(max(num_requests(c) for c in levels))
    started = time.perf_counter()

    results: list[SystemResult] = []
    engine_alone = None
    if "transformers" in keys:
        results.append(bench_transformers(model_dir, prompts, levels, slo, args.level_budget_s, gate))
    if PROFILE_LEVEL in levels and ("pd" in keys or "colocated" in keys or args.url):
        gate.wait()
        engine_alone = bench_engine_alone(model_dir, prompts[: num_requests(PROFILE_LEVEL)], PROFILE_LEVEL)
    if args.url:
        results.append(bench_http("url", _check_local(args.url), prompts, levels, slo, args.level_budget_s, gate))
    else:
        served = [k for k in keys if k in ("pd", "colocated")]
        if served:
            results += bench_local_serve(served, prompts, levels, slo, args.level_budget_s, gate, args.engine_threads,
                                         args.stream_interval)

    total_s = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    raw = {
        "settings": {"levels": levels, "max_tokens": MAX_TOKENS, "num_requests": {c: num_requests(c) for c in levels},
                     "level_budget_s": args.level_budget_s, "model": MODEL, "url": args.url,
                     "slo": dataclasses.asdict(slo), "total_s": total_s, "argv": sys.argv[1:],
                     "engine_threads": args.engine_threads, "stream_interval": args.stream_interval},
        "engine_alone": engine_alone,
        "systems": [dataclasses.asdict(r) for r in results],
    }  # fmt: skip
    (args.results / "results.json").write_text(json.dumps(raw, indent=1, default=str) + "\n")
    write_report(raw, args.out, args.results)
    print(f"bench done in {total_s:.0f}s: {args.out / 'RESULTS.md'}", flush=True)


if __name__ == "__main__":
    main()
