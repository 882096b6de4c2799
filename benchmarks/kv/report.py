"""KV.md from `benchmarks.kv.run`'s results (kv.json's structure); its hand-written notes survive
a rewrite (`benchmarks.reports`)."""

from __future__ import annotations

import datetime
import statistics
from pathlib import Path

from benchmarks.kv.transport import IDLE_S
from benchmarks.reports import RESULTS_DIR, kept_notes, link, machine


def _median(values) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1000:.1f}"


_PATTERN_LABELS = {"request": "on request", "idle": "on request after idle"}
RAW_OF = {"shm": "gloo"}  # shm replaces gloo between replicas of one node: it is held against raw gloo


def _handoff_table(result: dict, transport: str) -> list[str]:
    against = RAW_OF.get(transport, transport)
    figures = [f for f in result["raw"].get(against, []) if f.get("payload", "torch") == "torch"]
    raw = {f["num_bytes"]: f for f in figures if f.get("pattern", "one-way") == "one-way"}
    on_request = {pattern: {f["num_bytes"]: f for f in figures if f.get("pattern") == pattern}
                  for pattern in ("request", "idle")}
    on_request = {pattern: by_size for pattern, by_size in on_request.items() if by_size}
    numpy = {f["num_bytes"]: f for f in result["raw"].get(against, []) if f.get("payload") == "numpy"}
    label = f"raw {against}" if against != transport else "raw"
    extra = (" raw put + get ms | raw as numpy ms |" if numpy else "") + "".join(
        f" {label} {_PATTERN_LABELS[pattern]} ms | handoff / {_PATTERN_LABELS[pattern]} time |" for pattern in on_request)
    num_extra = bool(numpy) + len(on_request)  # pairs of extra columns
    lines = [f"| prompt tokens | KV MiB | handoff ms (median, min-max) | handoff GB/s | {label} ms | {label} GB/s "
             f"| handoff / {label} time | fallbacks (pushed) |{extra}", "|---:" * (8 + 2 * num_extra) + "|"]  # fmt: skip
    for length, samples in result["apps"][f"pd-{transport}"].items():
        kv_bytes = _median([s["kv_bytes"] for s in samples])
        seconds = [s["handoff_s"] for s in samples if s["handoff_s"] is not None]
        fallbacks = str(sum(1 for s in samples if s["fallback"]))
        if any(s.get("pushed") for s in samples):
            fallbacks += f" ({sum(1 for s in samples if s.get('pushed'))} pushed)"
        figure = raw.get(int(kv_bytes)) if kv_bytes else None
        if not seconds or not figure:
            lines.append(f"| {length} | — | — | — | — | — | — | {fallbacks} |" + " — | — |" * num_extra)
            continue
        handoff = statistics.median(seconds)
        row = (f"| {length} | {kv_bytes / 2**20:.2f} | {_ms(handoff)} ({_ms(min(seconds))}-{_ms(max(seconds))}) "
               f"| {kv_bytes / handoff / 1e9:.3f} | {_ms(figure['median_s'])} | {figure['gb_per_s']:.2f} "
               f"| {handoff / figure['median_s']:.2f}x | {fallbacks} |")  # fmt: skip
        if numpy:
            as_numpy = numpy.get(int(kv_bytes))
            numpy_s = as_numpy["median_s"] if as_numpy else None
            row += f" {_ms(figure['median_put_s'])} + {_ms(figure['median_get_s'])} | {_ms(numpy_s)} |"
        for by_size in on_request.values():
            asked = by_size.get(int(kv_bytes))
            row += f" {_ms(asked['median_s'])} | {handoff / asked['median_s']:.2f}x |" if asked else " — | — |"
        lines.append(row)
    return lines


def _ttft_table(result: dict) -> list[str]:
    apps = result["apps"]
    names = [n for n in apps if n.startswith("pd-")] + (["colocated"] if "colocated" in apps else [])
    lines = ["| prompt tokens | app | TTFT ms | 2nd token ms | TTFT / colocated | 2nd token / colocated |",
             "|---:|---|---:|---:|---:|---:|"]
    for length in apps[names[0]]:
        ttft = {n: _median([s["ttft_s"] for s in apps[n][length]]) for n in names}
        second = {n: _median([s["second_token_s"] for s in apps[n][length]]) for n in names}
        base_ttft, base_second = ttft.get("colocated"), second.get("colocated")
        for n in names:
            vs_ttft = f"{ttft[n] / base_ttft:.2f}x" if base_ttft else "—"
            vs_second = f"{second[n] / base_second:.2f}x" if base_second and second[n] else "—"
            lines.append(f"| {length} | {n} | {_ms(ttft[n])} | {_ms(second[n])} | {vs_ttft} | {vs_second} |")
    return lines


def write_kv_report(result: dict, path: Path, raw_path: Path = RESULTS_DIR / "kv.json") -> None:
    """KV.md at `path`, linking to the raw figures at `raw_path`."""
    m = machine()
    settings = result["settings"]
    notes = kept_notes(path)
    lines = [
        "# KV handoff figures", "",
        f"Written by `make bench-kv` (`benchmarks/kv/`) on {datetime.date.today().isoformat()}; total run "
        f"{settings['total_s']:.0f} s. Raw figures: [kv.json]({link(raw_path, path.parent)}). Throughput and "
        "latency under load: [RESULTS.md](RESULTS.md).", "",
        f"**Machine**: `nproc` = {m['nproc']}, {m['cpu_model']}, {m['ram_gib']:.1f} GiB RAM, torch {m['torch']} (CPU), "
        "shared with other work. gloo pairs: "
        + ("native (C++)." if settings.get("native_handoff") else "the Python protocol (the C++ side did not build)."),
        "",
        "## Setup", "",
        f"- One prefill + one decode replica (configs/cluster.yaml's options: 0.5 CPU each, one torch thread) on an "
        f"in-process Ray cluster, 127.0.0.1. Model `{settings['model']}`: KV is fp32, 4 layers x 2 x 2 KV heads x "
        "64 dims = 4 KiB per token, moved as whole 16-token blocks.",
        f"- Per prompt length, one untimed warm-up, then {settings['repeats']} requests one at a time (deterministic "
        f"random token ids, streaming, {settings['max_tokens']} new tokens, greedy, `ignore_eos`), read with httpx "
        "(raw SSE: the least client overhead between us and the timestamps).",
        "- **handoff** = the ledger's `handoff.seconds`: decode's view, from starting the fetch to the KV in its "
        "blocks and known good (checked against the lease's block generations and expiry; no step of the prefill "
        "engine is waited for) — shm: the decode engine copies the blocks straight out of the prefill engine's cache "
        "in shared memory and checks them, between two of its steps, as it admits the request; gloo: prefill, paired "
        "with this one decode replica, pushes each prompt's blocks as it leases them (`push_kv`, the default: "
        "pegaserve/pd/push.py), and decode copies what landed into its blocks, waiting for the rest where it "
        "has not all landed (the fallbacks column counts the pushed handoffs; the first request of a run opens the "
        "pair and fetches); a fetch: decode posts its receives and sends the fetch on the pair itself, and "
        "prefill's thread for that pair sends (runs of blocks as slabs cache to cache, else packed layer by layer) "
        "and then its verdict, both sides in C++ where `pegaserve/pd/transports/native.py` built (the machine line "
        "says); object store: decode's get and unpack. "
        "**raw** = the same bytes between two plain Ray actors with nothing else (`benchmarks/kv/transport.py`): "
        "gloo is one `ProcessGroupGloo` send/recv (the `GlooPair` the app uses), timed on the receiver, the sender "
        "sending back to back (the bandwidth: its next send is posted before the receive, and gloo's rendezvous "
        "sends the bytes from the sender's gloo thread the moment the receiver's ready notice comes) and **on "
        "request** (the receiver posts its receive and sends a 4-byte request; the sender waits for it, then sends: "
        "the least any fetch can do, a wake-up of the sender's thread more) and **on request after idle** (the same "
        f"after {IDLE_S} s of both sides idle before each transfer, as between this benchmark's handoffs: what waking a "
        "quiet machine costs the bare transport); object "
        "store is `ray.put` of the torch tensor in one actor + `ray.get` in the other (and, for comparison, the same "
        "bytes as a numpy array, which Ray stores without pickling and maps zero-copy on get). Median of 20 after "
        "2 warm-ups.",
        "- TTFT: P/D sends the first token from prefill before any KV moves, so the handoff shows in the time to "
        "the **second** token; both are given, medians, client side.", "",
    ]  # fmt: skip
    for name in result["apps"]:
        if name.startswith("pd-"):
            transport = name.removeprefix("pd-")
            lines += [f"## Handoff over {transport}", "", *_handoff_table(result, transport), ""]
    lines += ["## TTFT: P/D against colocated", "", *_ttft_table(result), "", "## Notes", "", notes, ""]
    path.write_text("\n".join(lines))
