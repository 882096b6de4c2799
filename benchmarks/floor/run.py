"""`make bench-floor` (see the package's docstring): each system in turn on 127.0.0.1, the same load
(streaming completions, random 128-token prompts, 64 tokens each, EOS ignored, no temperature sent,
at most C in flight), every process's CPU metered around it less its idle rate; then the same
requests with fewer tokens each, which splits each process's CPU into a part per request and a part
per token. Writes docs/bench/FLOOR.md and benchmarks/results/floor.json.

    python -m benchmarks.floor [--systems uvicorn,serve,serve-pd,pd,colocated] [--requests 128]
                               [--concurrency 16] [--rounds 2] [--short-tokens 16]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.cpu import CpuMeter, CpuUsage, QuietGate, during_load, idle_rates
from benchmarks.local_serve import HOST, free_port
from benchmarks.peers.report import SERVING_PROCESSES, cpu_split
from benchmarks.peers.run import CONFIG, colocated_config
from benchmarks.peers.servers import PEGASERVE_PORT, Launch, Server, ServerFailed, pegaserve_launch, wait_port_free
from benchmarks.reports import DOCS_DIR, REPO_ROOT, RESULTS_DIR, commit_text, kept_notes, link, machine, spread

SYSTEMS = {
    "uvicorn": "stand-in app, plain uvicorn",
    "serve": "stand-in app on Serve (as `make serve`)",
    "serve-pd": "stand-in app on Serve, with P/D's two Serve calls",
    "pd": "pegaserve P/D",
    "colocated": "pegaserve colocated",
}
FLOOR_CONFIG = Path(__file__).with_name("floor.yaml")
FLOOR_PD_CONFIG = Path(__file__).with_name("floor-pd.yaml")
PROMPT_TOKENS, OUTPUT_TOKENS = 128, 64
WARMUP_REQUESTS = 8
IDLE_S = 8.0
REQUEST_TIMEOUT_S = 120.0


def launch_for(key: str, run_dir: Path) -> Launch:
    venv = REPO_ROOT / ".venv"
    if key == "uvicorn":
        port = free_port()
        argv = (str(venv / "bin" / "python"), "-m", "uvicorn", "benchmarks.floor.app:app", "--host", HOST,
                "--port", str(port), "--no-access-log")  # fmt: skip
        return Launch(key, argv, REPO_ROOT, port, ready_timeout_s=60)
    configs = {"serve": FLOOR_CONFIG, "serve-pd": FLOOR_PD_CONFIG, "pd": CONFIG}
    config = configs.get(key) or colocated_config(CONFIG, run_dir / "colocated.yaml")
    return pegaserve_launch(key, config, venv, REPO_ROOT)


async def stream_load(url: str, num_requests: int, concurrency: int, seed: int,
                      output_tokens: int = OUTPUT_TOKENS) -> dict:
    """`num_requests` streamed completions of `output_tokens` each, at most `concurrency` in flight:
    the chunks that carried a choice, the requests that ended with `[DONE]`, and the wall time."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 30000) for _ in range(PROMPT_TOKENS)] for _ in range(num_requests)]
    counts = {"chunks": 0, "completed": 0}
    slots = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> None:
        body = {"model": "qwen3-tiny", "prompt": prompt, "max_tokens": output_tokens, "ignore_eos": True,
                "stream": True}  # fmt: skip
        async with slots, client.stream("POST", f"{url}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    counts["completed"] += 1
                elif line.startswith("data: ") and json.loads(line[6:]).get("choices"):
                    counts["chunks"] += 1

    limits = httpx.Limits(max_connections=concurrency + 4)
    started = time.monotonic()
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        await asyncio.gather(*(one(client, prompt) for prompt in prompts))
    return {**counts, "duration_s": time.monotonic() - started}


def bench_system(system: dict, round_: int, args: argparse.Namespace, run_dir: Path, gate: QuietGate) -> None:
    key = system["key"]
    launch = launch_for(key, run_dir)
    if launch.port == PEGASERVE_PORT:
        wait_port_free(PEGASERVE_PORT, 600)
    log = run_dir / f"{key}-{round_}.log"
    print(f"{system['name']}, round {round_ + 1}: starting (log {log})", flush=True)
    try:
        with Server(launch, log):
            asyncio.run(stream_load(launch.url, WARMUP_REQUESTS, WARMUP_REQUESTS, seed=-1))
            gate.wait()
            idle_per_s = idle_rates(IDLE_S)

            def metered(output_tokens: int) -> tuple[dict, CpuUsage]:
                meter = CpuMeter()
                meter.start()
                result = asyncio.run(stream_load(launch.url, args.requests, args.concurrency, round_, output_tokens))
                if result["completed"] < args.requests:  # a stream cut short: its tokens' cost would be misread
                    raise LoadFailed(f"only {result['completed']} of {args.requests} streams ended with [DONE]")
                return result, meter.stop(result["duration_s"])

            result, cpu = metered(OUTPUT_TOKENS)
            short = metered(args.short_tokens) if 0 < args.short_tokens < OUTPUT_TOKENS else None
    except (ServerFailed, httpx.HTTPError, LoadFailed) as e:
        system["error"] = f"{type(e).__name__}: {e}"
        print(f"  FAILED: {system['error']}", flush=True)
        return
    during = during_load(cpu, result["duration_s"], idle_per_s)
    tokens = max(1, result["chunks"])
    by_process_ms = {label: cpu_s * 1e3 / tokens for label, cpu_s in during.items()}
    split_ms = {kind: cpu_s * 1e3 / tokens for kind, cpu_s in cpu_split(during).items()}
    run = {**result, "round": round_, "tokens_per_s": result["chunks"] / result["duration_s"],
           "others_cores": cpu.others_s / cpu.wall_s, "ms_per_token": split_ms, "process_ms_per_token": by_process_ms}
    if short is not None:
        short_during = during_load(short[1], short[0]["duration_s"], idle_per_s)
        run["per_request_and_token"] = split_per_request(during, result["chunks"], short_during, short[0]["chunks"],
                                                         args.requests)
    system["runs"].append(run)
    print(f"  {result['completed']}/{args.requests} done, {run['tokens_per_s']:.0f} tok/s, serving path "
          f"{split_ms['serving']:.3f} CPU-ms/token, others {run['others_cores']:.2f} cores", flush=True)  # fmt: skip


class LoadFailed(RuntimeError):
    pass


def split_per_request(long: dict[str, float], long_tokens: int, short: dict[str, float], short_tokens: int,
                      num_requests: int) -> dict[str, tuple[float, float]]:
    """Each process's CPU-ms (and the kinds' of `cpu_split`) as (per request, per token), from two
    loads of the same requests with different numbers of tokens: cpu = requests * a + tokens * b.
    What a process spends per second of load, not per token (metrics, health checks), counts as per
    token here, more so the longer the load."""

    def fit(long_s: float, short_s: float) -> tuple[float, float]:
        per_token = (long_s - short_s) / max(1, long_tokens - short_tokens)
        return (long_s - per_token * long_tokens) * 1e3 / num_requests, per_token * 1e3

    labels = set(long) | set(short)
    fitted = {label: fit(long.get(label, 0.0), short.get(label, 0.0)) for label in labels}
    long_kinds, short_kinds = cpu_split(long), cpu_split(short)
    return {**fitted, **{f"kind:{kind}": fit(long_kinds[kind], short_kinds[kind]) for kind in long_kinds}}


def _median(runs: list[dict], pick) -> float:
    return statistics.median(pick(run) for run in runs)


def _serving_processes(runs: list[dict]) -> str:
    labels = {label for run in runs for label in run["process_ms_per_token"] if label.startswith(SERVING_PROCESSES)}
    medians = {label: _median(runs, lambda r, lb=label: r["process_ms_per_token"].get(lb, 0.0)) for label in labels}
    return ", ".join(f"{label} {ms:.3f}" for label, ms in sorted(medians.items(), key=lambda kv: -kv[1]) if ms >= 0.001)


def write_report(raw: dict, out: Path, results: Path = RESULTS_DIR) -> None:
    """FLOOR.md into `out`, linking to floor.json in `results`."""
    path = out / "FLOOR.md"
    notes = kept_notes(path)
    s, m = raw["settings"], raw["machine"]
    lines = [
        "# The HTTP floor: one streamed token's CPU with no engine behind it", "",
        f"Written by `make bench-floor` (`benchmarks/floor/`) on {raw['date']}; total run {s['total_s']:.0f} s, "
        f"{s['rounds']} round(s): medians, the rounds' range in parentheses. Raw figures: "
        f"[floor.json]({link(results / 'floor.json', out)}).", "",
        f"**Machine**: {m['cpu_model']}, `nproc` = {m['nproc']}, {m['ram_gib']:.1f} GiB RAM; pegaserve at "
        f"{raw['commit']}. The machine may be shared: `others` is what processes outside this benchmark used, in "
        "cores.", "",
        "## Setup", "",
        "- The stand-in app (`benchmarks/floor/app.py`): FastAPI, `POST /v1/completions` streams one OpenAI "
        "completion chunk per token, every running stream woken by one timer per step (30 ms), as pegaserve's "
        "ingress is by one frame per engine step. No model, no tokenizer, no Serve calls, no ledger.",
        "- *plain uvicorn*: `python -m uvicorn benchmarks.floor.app:app`. *on Serve*: `serve run "
        "benchmarks/floor/floor.yaml`, with `make serve`'s environment (HAProxy in front, Serve's throughput "
        "mode) and the Ingress's options. *with P/D's two Serve calls*: `floor-pd.yaml`, the same app making, per "
        "request, the two Serve calls pegaserve's ingress makes in P/D: one to a `Prefill` deployment answered at "
        "once, one to a `Decode` deployment held open while the request streams (no-ops, with those deployments' "
        "options). pegaserve: `serve run configs/cluster.yaml`, and its colocated variant.",
        f"- The same load for all: {s['requests']} streamed completions of random {PROMPT_TOKENS}-token prompts, "
        f"{OUTPUT_TOKENS} tokens each (`ignore_eos`, no temperature sent), at most {s['concurrency']} in flight, "
        "read with httpx; the CPU of every process each system started, metered around the load, less its idle "
        f"rate (metered {IDLE_S:.0f} s after a warm-up). *Serving path* as in PEERS.md: HTTP servers, proxies, "
        "the replicas (around the engines, for pegaserve).", "",
        "| system | tokens/s | serving path CPU-ms/token | its processes | engines | Ray and the rest "
        "| others (cores) |",
        "|---|---:|---:|---|---:|---:|---:|",
    ]  # fmt: skip
    for system in raw["systems"]:
        runs = system["runs"]
        if not runs:
            lines.append(f"| {system['name']} | failed: {system['error']} | | | | | |")
            continue
        serving = spread([r["ms_per_token"]["serving"] for r in runs], digits=3)
        engine, rest = (_median(runs, lambda r, k=kind: r["ms_per_token"][k]) for kind in ("engine", "rest"))
        lines.append(f"| {system['name']} | {_median(runs, lambda r: r['tokens_per_s']):.0f} | {serving} | "
                     f"{_serving_processes(runs)} | {engine:.3f} | {rest:.3f} | "
                     f"{_median(runs, lambda r: r['others_cores']):.2f} |")  # fmt: skip
    lines += _split_table(raw)
    lines += ["", "## Notes", "", notes, ""]
    path.write_text("\n".join(lines))


def _split_table(raw: dict) -> list[str]:
    """Per request and per token, for the systems that ran the short load too."""
    rows = []
    for system in raw["systems"]:
        runs = [r for r in system["runs"] if "per_request_and_token" in r]
        if not runs:
            continue

        def median(label: str, i: int, runs=runs) -> float:
            return _median(runs, lambda run, lb=label, k=i: run["per_request_and_token"].get(lb, (0.0, 0.0))[k])

        labels = {label for r in runs for label in r["per_request_and_token"] if label.startswith(SERVING_PROCESSES)}
        parts = sorted(((median(label, 0), median(label, 1), label) for label in labels),
                       key=lambda p: -(p[0] / OUTPUT_TOKENS + p[1]))  # by the cost at OUTPUT_TOKENS a request
        named = ", ".join(f"{label} {a:.2f} + {b:.3f}" for a, b, label in parts if a >= 0.005 or b >= 0.001)
        rows.append(f"| {system['name']} | {median('kind:serving', 0):.2f} | {median('kind:serving', 1):.3f} | "
                    f"{named} | {median('kind:rest', 0):.2f} + {median('kind:rest', 1):.3f} |")
    if not rows:
        return []
    short = raw["settings"].get("short_tokens")
    return [
        "", "## Per request and per token", "",
        f"Each system also served the same requests with {short} tokens each instead of {OUTPUT_TOKENS}; the two "
        "loads split each process's CPU into a part per request and a part per token (cpu = requests x a + "
        "tokens x b; what a process spends per second under load counts as per token). At "
        f"{OUTPUT_TOKENS} tokens a request, a/{OUTPUT_TOKENS} + b is the per-token figure above.", "",
        "| system | serving path ms/request | serving path ms/token | its processes (ms/request + ms/token) "
        "| Ray and the rest |",
        "|---|---:|---:|---|---:|",
        *rows,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, of {tuple(SYSTEMS)}")
    parser.add_argument("--requests", type=int, default=128, help="streamed completions per measurement")
    parser.add_argument("--concurrency", type=int, default=16, help="most requests in flight")
    parser.add_argument("--rounds", type=int, default=2, help="times the whole sequence of systems runs")
    parser.add_argument("--short-tokens", type=int, default=16,
                        help=f"tokens per request of the second load (below {OUTPUT_TOKENS}; 0: no second load)")
    parser.add_argument("--out", type=Path, default=DOCS_DIR, help="where FLOOR.md goes")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where floor.json goes")
    parser.add_argument("--render", type=Path, default=None, metavar="FLOOR_JSON",
                        help="only rewrite FLOOR.md in --out from this floor.json")  # fmt: skip
    args = parser.parse_args(argv)
    if args.render:
        args.out.mkdir(parents=True, exist_ok=True)
        write_report(json.loads(args.render.read_text()), args.out, args.results)
        return
    keys = [k.strip() for k in args.systems.split(",") if k.strip()]
    if unknown := set(keys) - set(SYSTEMS):
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {tuple(SYSTEMS)}")
    run_dir = Path(tempfile.mkdtemp(prefix="bench-floor-"))
    print(f"bench-floor: server logs in {run_dir}", flush=True)
    started = time.monotonic()
    gate = QuietGate()
    systems = [{"key": key, "name": SYSTEMS[key], "runs": [], "error": None} for key in keys]
    for round_ in range(args.rounds):
        for system in systems:
            if system["error"] is None:
                bench_system(system, round_, args, run_dir, gate)
    raw = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "commit": commit_text(),
           "settings": {"requests": args.requests, "concurrency": args.concurrency, "rounds": args.rounds,
                        "short_tokens": args.short_tokens,
                        "total_s": time.monotonic() - started},
           "machine": machine(), "systems": systems}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "floor.json").write_text(json.dumps(raw, indent=1) + "\n")
    write_report(raw, args.out, args.results)
    print(f"bench-floor done in {raw['settings']['total_s']:.0f} s: {args.out / 'FLOOR.md'}", flush=True)
    if any(s["error"] for s in systems):
        sys.exit(1)
