"""`make bench-interference`: the reason P/D exists, measured. Long prompts arrive while other
requests decode steadily; how much do the steady streams' inter-token latencies suffer?

For each system (P/D and colocated, deployed one at a time on an in-process Ray cluster, or one
running server with `--url`), `--streams` clients loop short greedy requests (64-token prompts,
128 tokens out, EOS ignored, streaming, the official `openai` client) for `--seconds`, while an
interferer sends a fresh long prompt (`--long-tokens`, distinct each time so no prefix cache
helps) every `--long-every-s`, at most two outstanding. The steady streams' ITL (the gap between
token-carrying chunks, spread over the tokens a chunk carries; first tokens excluded) is reported
as p50/p90/p99/max beside the interferer's TTFT. A benchmark, not a test: it asserts nothing.

The load decides what p99 sees: only the steps that carry a long prompt stall, so they must be more
than 1% of the steady streams' tokens. At the default (one long prompt every 0.5 s) they are ~1.6%
on the fastest host seen (the 8 streams decoding ~1000 tokens/s); one a second gave ~1.6% on hosts
half as fast, but ~0.8% there, under the 99th percentile; one every 2 s, ~0.7% on the slow hosts.

Writes docs/bench/INTERFERENCE.md, and benchmarks/results/interference.json and interference.png.

    python -m benchmarks.interference [--systems pd,colocated] [--seconds 60] [--url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from benchmarks.reports import DOCS_DIR, RESULTS_DIR, kept_notes, link, machine

OUT = DOCS_DIR  # INTERFERENCE.md
RESULTS = RESULTS_DIR  # interference.json and interference.png
MODEL = "qwen3-tiny"
SYSTEMS = {"pd": "pegaserve P/D", "colocated": "pegaserve colocated"}
STEADY_PROMPT_TOKENS = 64
STEADY_NEW_TOKENS = 128
TIMEOUT_S = 180.0


@dataclass
class SystemRun:
    system: str
    itl_s: list[float] = field(default_factory=list)  # steady streams, every token after the first
    steady_tokens: int = 0
    steady_requests: int = 0
    long_ttft_s: list[float] = field(default_factory=list)
    long_requests: int = 0
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict:
        itl = sorted(self.itl_s)

        def pct(p: float) -> float | None:
            return itl[min(len(itl) - 1, int(p / 100 * len(itl)))] * 1000 if itl else None

        return {
            "system": self.system, "itl_p50_ms": pct(50), "itl_p90_ms": pct(90), "itl_p99_ms": pct(99),
            "itl_max_ms": itl[-1] * 1000 if itl else None,
            "steady_tok_s": self.steady_tokens / self.wall_s if self.wall_s else None,
            "steady_requests": self.steady_requests, "long_requests": self.long_requests,
            "long_ttft_p50_ms": statistics.median(self.long_ttft_s) * 1000 if self.long_ttft_s else None,
            "errors": len(self.errors),
        }  # fmt: skip


def prompt(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(100, 150_000) for _ in range(num_tokens)]


async def steady(client, run: SystemRun, rng: random.Random, deadline: float) -> None:
    while time.perf_counter() < deadline:
        try:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt(rng, STEADY_PROMPT_TOKENS), max_tokens=STEADY_NEW_TOKENS,
                temperature=0.0, stream=True, extra_body={"ignore_eos": True, "return_token_ids": True},
            )  # fmt: skip
            last = None
            async for chunk in stream:
                now = time.perf_counter()
                n = len((chunk.choices[0].model_extra or {}).get("token_ids") or ()) if chunk.choices else 0
                if not n:
                    continue
                if last is not None:
                    run.itl_s += [(now - last) / n] * n
                last = now
                run.steady_tokens += n
            run.steady_requests += 1
        except Exception as exc:  # counted, never fatal
            run.errors.append(f"{type(exc).__name__}: {exc}")


async def interferer(client, run: SystemRun, rng: random.Random, deadline: float, every_s: float,
                     long_tokens: int) -> None:
    outstanding: set[asyncio.Task] = set()

    async def one() -> None:
        start = time.perf_counter()
        try:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt(rng, long_tokens), max_tokens=4, temperature=0.0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            first = None
            async for _ in stream:
                first = first or time.perf_counter()
            run.long_ttft_s.append((first or time.perf_counter()) - start)
            run.long_requests += 1
        except Exception as exc:
            run.errors.append(f"long: {type(exc).__name__}: {exc}")

    while time.perf_counter() < deadline:
        if len(outstanding) < 2:
            task = asyncio.ensure_future(one())
            outstanding.add(task)
            task.add_done_callback(outstanding.discard)
        await asyncio.sleep(every_s)
    if outstanding:
        await asyncio.wait(outstanding, timeout=TIMEOUT_S)


async def measure(url: str, system: str, args) -> SystemRun:
    from openai import AsyncOpenAI  # noqa: PLC0415

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    rng = random.Random(7)
    warm = SystemRun(system)
    await asyncio.gather(*(steady(client, warm, rng, time.perf_counter() + 5) for _ in range(2)),
                         interferer(client, warm, rng, time.perf_counter() + 5, 2.0, args.long_tokens))
    run = SystemRun(system)
    start = time.perf_counter()
    deadline = start + args.seconds
    await asyncio.gather(*(steady(client, run, rng, deadline) for _ in range(args.streams)),
                         interferer(client, run, rng, deadline, args.long_every_s, args.long_tokens))
    run.wall_s = time.perf_counter() - start
    await client.close()
    return run


def report(runs: list[SystemRun], args) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    summaries = [r.summary() for r in runs]
    meta = {"machine": machine(), "date": time.strftime("%Y-%m-%d %H:%M"), "streams": args.streams,
            "seconds": args.seconds, "long_tokens": args.long_tokens, "long_every_s": args.long_every_s}
    (RESULTS / "interference.json").write_text(json.dumps({"meta": meta, "summaries": summaries,
                                                           "runs": [asdict(r) for r in runs]}))
    lines = ["# Decode latency under long-prompt interference", "",
             f"{args.streams} steady streams ({STEADY_PROMPT_TOKENS}-token prompts, {STEADY_NEW_TOKENS} tokens out, "
             f"greedy) while a fresh {args.long_tokens}-token prompt arrives every {args.long_every_s} s (at most two "
             f"outstanding), {args.seconds} s per system, one system at a time, `python -m benchmarks.interference`.",
             f"Machine: {meta['machine']['cpu_model']}, {meta['machine']['nproc']} cores. Date: {meta['date']}.", "",
             "| system | ITL p50 ms | p90 | p99 | max | steady tok/s | long prompts | long TTFT p50 ms | errors |",
             "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "—" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"  # noqa: E731
    for s in summaries:
        lines.append(f"| {SYSTEMS.get(s['system'], s['system'])} | {fmt(s['itl_p50_ms'])} | {fmt(s['itl_p90_ms'])} | "
                     f"{fmt(s['itl_p99_ms'])} | {fmt(s['itl_max_ms'])} | {fmt(s['steady_tok_s'])} | "
                     f"{s['long_requests']} | {fmt(s['long_ttft_p50_ms'])} | {s['errors']} |")
    by = {s["system"]: s for s in summaries}
    if "pd" in by and "colocated" in by and by["colocated"]["itl_p99_ms"]:
        ratio = by["pd"]["itl_p99_ms"] / by["colocated"]["itl_p99_ms"]
        lines += ["", f"**ITL p99, P/D / colocated: {ratio:.2f}x** (target ≤ 0.5x)."]
    lines += ["", f"![ITL under interference]({link(RESULTS / 'interference.png', OUT)})", "", "## Notes", "",
              kept_notes(OUT / "INTERFERENCE.md"), ""]
    (OUT / "INTERFERENCE.md").write_text("\n".join(lines))
    plot(runs)
    print("\n".join(lines))


def plot(runs: list[SystemRun]) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        itl = sorted(x * 1000 for x in r.itl_s)
        if itl:
            ax.plot(itl, [i / len(itl) for i in range(len(itl))], label=SYSTEMS.get(r.system, r.system))
    ax.set_xscale("log")
    ax.set_xlabel("inter-token latency of the steady streams (ms, log)")
    ax.set_ylabel("fraction of tokens")
    ax.axhline(0.99, color="grey", lw=0.5, ls="--")
    ax.legend()
    ax.set_title("Decode ITL while long prompts arrive")
    fig.tight_layout()
    fig.savefig(RESULTS / "interference.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="pd,colocated")
    parser.add_argument("--url", default=None, help="measure this running server (one system) instead")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=1536)
    parser.add_argument("--long-every-s", type=float, default=0.5)
    args = parser.parse_args()
    runs = []
    if args.url:
        runs.append(asyncio.run(measure(args.url, args.systems.split(",")[0], args)))
    else:
        from benchmarks.local_serve import LocalServe  # noqa: PLC0415

        with LocalServe() as local:
            for system in args.systems.split(","):
                url = local.deploy(system, {"mode": "colocated" if system == "colocated" else "pd",
                                            "ledger_journal": None})
                runs.append(asyncio.run(measure(url, system, args)))
                local.delete(system)
    report(runs, args)


if __name__ == "__main__":
    main()
