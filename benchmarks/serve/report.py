"""RESULTS.md and the two plots, from the benchmark's raw results (results.json's structure).

The hand-written notes of an existing RESULTS.md are kept when it is rewritten (`benchmarks.reports`).
"""

from __future__ import annotations

import datetime
import math
import statistics
from pathlib import Path

from benchmarks.reports import RESULTS_DIR, kept_notes, link, machine

REFERENCE_KEY = "transformers"


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:.0f}"


def _levels(system: dict) -> dict[int, dict]:
    return {level["concurrency"]: level for level in system["levels"]}


def _throughput_table(systems: list[dict], levels: list[int]) -> list[str]:
    by_key = {s["key"]: _levels(s) for s in systems}
    names = [s["levels"][0]["system"] for s in systems if s["levels"]]
    head = "| concurrency | " + " | ".join(names) + " |"
    ratio_keys = [k for k in by_key if k != REFERENCE_KEY] if REFERENCE_KEY in by_key else []
    head += "".join(f" {k} / transformers |" for k in ratio_keys)
    lines = [head, "|---:" * (1 + len(names) + len(ratio_keys)) + "|"]
    for c in levels:
        row = [f"{by_key[s['key']][c]['output_tokens_per_s']:.1f}" if c in by_key[s["key"]] else "—"
               for s in systems if s["levels"]]  # fmt: skip
        for k in ratio_keys:
            ref, mine = by_key[REFERENCE_KEY].get(c), by_key[k].get(c)
            row.append(f"{mine['output_tokens_per_s'] / ref['output_tokens_per_s']:.2f}x" if ref and mine else "—")
        lines.append(f"| {c} | " + " | ".join(row) + " |")
    return lines


def _latency_table(system: dict) -> list[str]:
    lines = ["| concurrency | ok / sent | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s "
             "| goodput req/s (met SLO) | wall s | client CPU s | others' CPU (cores) | load 1m |",
             "|---:" * 12 + "|"]  # fmt: skip
    for s in system["levels"]:
        cpu = system["cpu"].get(str(s["concurrency"])) or system["cpu"].get(s["concurrency"])
        others = _others_s(cpu) / cpu["wall_s"] if cpu and cpu["wall_s"] else math.nan
        client = "—" if s["client_cpu_s"] is None else f"{s['client_cpu_s']:.1f}"
        lines.append(
            f"| {s['concurrency']} | {s['num_requests'] - s['num_failed']} / {s['num_requests']} "
            f"| {_ms(s['ttft_p50_s'])} | {_ms(s['ttft_p99_s'])} | {_ms(s['itl_p50_s'])} | {_ms(s['itl_p99_s'])} "
            f"| {s['output_tokens_per_s']:.1f} | {s['goodput_rps']:.2f} ({s['num_slo_met']}) | {s['wall_s']:.1f} "
            f"| {client} | {others:.2f} | {s['load_avg_1m']:.1f} |"
        )  # fmt: skip
    return lines


def _others_s(cpu: dict) -> float:
    return max(0.0, cpu["machine_busy_s"] - sum(cpu["by_component_s"].values()))


def _cpu_table(system: dict, level: int, nproc: int) -> list[str]:
    cpu = system["cpu"].get(str(level)) or system["cpu"].get(level)
    summary = _levels(system).get(level)
    if not cpu or not summary:
        return []
    tokens = max(1, summary["num_output_tokens"])
    rows = sorted(cpu["by_component_s"].items(), key=lambda kv: -kv[1])
    lines = [f"**{summary['system']}**, concurrency {level}: {summary['num_output_tokens']} output tokens in "
             f"{cpu['wall_s']:.1f} s wall; the machine was busy {cpu['machine_busy_s']:.1f} CPU-s "
             f"({cpu['machine_busy_s'] / cpu['wall_s']:.2f} of {nproc} cores).", "",
             "| process | CPU s | cores | CPU ms per output token |", "|---|---:|---:|---:|"]  # fmt: skip
    for name, cpu_s in [*rows, ("others (not this benchmark)", _others_s(cpu))]:
        if cpu_s >= 0.05:
            lines.append(f"| {name} | {cpu_s:.1f} | {cpu_s / cpu['wall_s']:.2f} | {cpu_s / tokens * 1000:.1f} |")
    return lines


def _ledger_phases(system: dict) -> list[str]:
    """Median/p90 of each phase of the profile level's requests, client clock lined up with the
    ledger's (both are this machine's clock)."""
    offset = system["client_offset_s"]
    client = {t["request_id"]: t for t in system["profile_timings"]}
    phases: dict[str, list[float]] = {}
    for record in system["ledger"]:
        timing = client.get(record["request_id"])
        events = {e["name"]: e["t"] for e in record["events"]}
        if timing is None or "arrived" not in events or "prefilled" not in events:
            continue
        marks = {"sent": timing["start_s"] + offset, "first token at client": timing["first_s"] + offset,
                 "last byte at client": timing["end_s"] + offset, **events}  # fmt: skip
        for label, a, b in (
            ("client send → ingress `arrived` (HTTP proxy, Serve hop, validation, tokenizer)", "sent", "arrived"),
            ("`arrived` → `prefilled` (prefill queue + forward, the result back at the ingress)", "arrived", "prefilled"),
            ("`prefilled` → first token at client (out through ingress and proxy)", "prefilled",
             "first token at client"),
            ("`prefilled` → `kv_received` (decode call, KV fetch and transfer)", "prefilled", "kv_received"),
            ("`kv_received` → last byte at client (63 decode steps, streamed)", "kv_received", "last byte at client"),
        ):  # fmt: skip
            if a in marks and b in marks:
                phases.setdefault(label, []).append(marks[b] - marks[a])
    if not phases:
        return []
    lines = ["| phase | median ms | p90 ms | n |", "|---|---:|---:|---:|"]
    for label, values in phases.items():
        ordered = sorted(values)
        p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
        lines.append(f"| {label} | {statistics.median(values) * 1000:.0f} | {p90 * 1000:.0f} | {len(values)} |")
    return lines


def _target(systems: list[dict], level: int) -> str:
    by_key = {s["key"]: _levels(s) for s in systems}
    pd = (by_key.get("pd") or by_key.get("url") or {}).get(level)
    ref = by_key.get(REFERENCE_KEY, {}).get(level)
    if not pd or not ref:
        return "Target not evaluated (P/D or transformers not run at concurrency 16)."
    ratio = pd["output_tokens_per_s"] / ref["output_tokens_per_s"]
    verdict = "**met**" if ratio >= 1.0 else "**missed**"
    return (f"Target — P/D over HTTP at concurrency {level} >= transformers' batch-{level} offline generate: "
            f"{pd['output_tokens_per_s']:.1f} vs {ref['output_tokens_per_s']:.1f} output tokens/s = "
            f"**{ratio:.2f}x**, {verdict}.")  # fmt: skip


def write_report(raw: dict, out: Path, results: Path = RESULTS_DIR) -> None:
    """RESULTS.md into `out`, its plots into `results` (beside results.json)."""
    from benchmarks.serve.stats import Slo  # noqa: PLC0415

    systems = [s for s in raw["systems"] if s["levels"]]
    settings = raw["settings"]
    levels = list(settings["levels"])
    m = machine()
    slo = Slo(**settings["slo"])
    path = out / "RESULTS.md"
    notes = kept_notes(path)
    results.mkdir(parents=True, exist_ok=True)
    plot(systems, results)
    raw_link = link(results / "results.json", out)
    throughput_link, latency_link = link(results / "throughput.png", out), link(results / "latency.png", out)
    today = datetime.date.today().isoformat()
    requests = ", ".join(f"{n} at {c}" for c, n in settings["num_requests"].items())
    lines = [
        "# pegaserve benchmark results", "",
        f"Written by `make bench` (`benchmarks/serve/`) on {today}; total run {settings['total_s']:.0f} s. "
        f"Raw figures: [results.json]({raw_link}). KV handoff figures: [KV.md](KV.md).", "",
        f"**Machine**: `nproc` = {m['nproc']}, {m['cpu_model']}, {m['ram_gib']:.1f} GiB RAM, Linux {m['kernel']}, "
        f"Python {m['python']}, torch {m['torch']} (CPU). The machine is shared: the `others' CPU` column is what "
        "processes outside the benchmark used during each level, in cores.", "",
        "## Setup", "",
        f"- Model `{settings['model']}` (Qwen3, hidden 256, 4 layers, vocab 151,936, fp32, random weights).",
        f"- Prompts: `benchmarks.engine.make_prompts` — deterministic token ids, lengths spread over 16-128; "
        f"level with N requests sends the first N. {settings['max_tokens']} new tokens each, temperature 0, "
        f"`ignore_eos` (every request runs the full length). Requests per level: {requests}; no request starts "
        f"later than {settings['level_budget_s']:.0f} s into a level.",
        "- pegaserve: official `openai` client (`AsyncOpenAI`, `stream=True`, `stream_options.include_usage`, "
        "`return_token_ids` so every chunk says how many tokens it carries), one worker per concurrency slot, "
        "in the benchmark process. Apps started in-process on 127.0.0.1 with configs/cluster.yaml's replica "
        "options (Ingress 0.25 CPU; Prefill, Decode, Colocated 0.5 CPU each, so each engine runs one torch "
        "thread), shm transport (shared memory between the replicas), one prefill + one decode replica; warmed up "
        "with 4 requests first.",
        "- transformers: `Qwen3ForCausalLM.generate` in the benchmark process (torch default threads = "
        f"{m['nproc']}), batch = concurrency, left padding, `max_new_tokens = min_new_tokens = "
        f"{settings['max_tokens']}`, `eos_token_id=None`, greedy. TTFT is from the start of the row's batch, ITL "
        "is step to step (a streamer stamps each step); batches run back to back.",
        "- Output tokens/s = all output tokens of the level / level wall time (first send to last byte). TTFT = "
        "send to first token-carrying chunk; ITL = gaps between token-carrying chunks.",
        "- Before each level the benchmark waits (at most 20 s, 120 s per run) until other processes use under "
        "half a core, records what they used during the level (`others' CPU`), and measures a level again (once) "
        "when they took more than half a core."
        + (" With `--url` the server is not this benchmark's process tree, so its CPU counts under `others`."
           if settings.get("url") else ""),
        f"- **SLO** for goodput: {slo.describe()}. {' '.join(Slo.__doc__.split(chr(10) + chr(10))[1].split())} "
        "Goodput = requests meeting it / level wall time.", "",
        "## Throughput", "", f"![throughput]({throughput_link})", "",
        *_throughput_table(systems, levels), "",
        _target(systems, 16), "",
        "## Latency", "", f"![latency]({latency_link})", "",
    ]  # fmt: skip
    for system in systems:
        lines += [f"### {system['levels'][0]['system']}", "", *_latency_table(system), ""]
    lines += ["## Where the time goes (concurrency 16)", ""]
    if raw.get("engine_alone"):
        e = raw["engine_alone"]
        lines += [f"pegaserve's engine alone (same {e['num_requests']} prompts, `max_num_seqs` {e['max_num_seqs']}, "
                  f"{e['threads']} torch thread as in a replica, no Ray, no HTTP): "
                  f"**{e['output_tokens_per_s']:.1f} output tokens/s**.", ""]  # fmt: skip
    lines += ["CPU time per process during the level (this benchmark's process tree; `others` is the rest "
              "of the machine):", ""]
    for system in systems:
        lines += [*_cpu_table(system, 16, m["nproc"]), ""]
    for system in systems:
        phases = _ledger_phases(system)
        if phases:
            lines += [f"Per-request phases of **{system['levels'][0]['system']}** at concurrency 16, from the ledger's "
                      "event times (stamped when the ledger actor receives them, so each is a little late):", "",
                      *phases, ""]  # fmt: skip
    lines += ["## Notes", "", notes, ""]
    path.write_text("\n".join(lines))


def plot(systems: list[dict], out: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.ticker import FuncFormatter  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in systems:
        xs = [s["concurrency"] for s in system["levels"]]
        ys = [s["output_tokens_per_s"] for s in system["levels"]]
        ax.plot(xs, ys, marker="o", label=system["levels"][0]["system"])
    ax.set(xscale="log", xlabel="concurrency (transformers: batch size)", ylabel="output tokens/s",
           title="Throughput vs concurrency (qwen3-tiny, 64 new tokens, CPU)")  # fmt: skip
    _log2_ticks(ax, systems)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, metric, title in ((axes[0], "ttft", "TTFT"), (axes[1], "itl", "Inter-token latency")):
        for i, system in enumerate(systems):
            xs = [s["concurrency"] for s in system["levels"]]
            name = system["levels"][0]["system"]
            for q, style in (("p50", "-"), ("p99", "--")):
                ys = [s[f"{metric}_{q}_s"] * 1000 for s in system["levels"]]
                ax.plot(xs, ys, style, marker="o", color=f"C{i}", label=f"{name} {q}")
        ax.set(xscale="log", yscale="log", xlabel="concurrency (transformers: batch size)", ylabel="ms (log scale)",
               title=title)
        _log2_ticks(ax, systems)
        plain = FuncFormatter(lambda value, _: f"{value:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "latency.png", dpi=120)
    plt.close(fig)


def _log2_ticks(ax, systems: list[dict]) -> None:
    from matplotlib.ticker import NullLocator  # noqa: PLC0415

    xs = sorted({s["concurrency"] for system in systems for s in system["levels"]})
    ax.set_xticks(xs)
    ax.set_xticklabels([str(x) for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
