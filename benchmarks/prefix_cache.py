"""`make bench-prefix`: automatic prefix caching on a shared-prefix workload, P/D over HTTP, with
`engine.enable_prefix_caching` on and off.

Every request is one long shared prefix (a system prompt, `--shared-tokens`) plus a short suffix of
its own, sent one at a time after one untimed warm-up (greedy, EOS ignored, a few tokens out). Per
setting: the client's TTFT; the prefill replicas' prefix-cache hit rate over the timed requests
(/admin/stats); and from each request's ledger record the KV bytes that moved to decode and those
decode already held in its own prefix cache (`cached_bytes`: bytes the handoff saved). The tokens
must be the same either way. A benchmark, not a test: it asserts nothing but prints and writes
benchmarks/results/prefix.json and docs/bench/PREFIX.md.

    python -m benchmarks.prefix_cache [--shared-tokens 1024] [--requests 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
import torch

from benchmarks.reports import DOCS_DIR, RESULTS_DIR, kept_notes, link, machine

MODEL = "qwen3-tiny"
SUFFIX_TOKENS = 32
MAX_TOKENS = 4
FIRST_ORDINARY_ID, LAST_ORDINARY_ID = 100, 150_000  # clear of the special ids (151643+)


def prompts(shared_tokens: int, count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(2024)
    shared = torch.randint(FIRST_ORDINARY_ID, LAST_ORDINARY_ID, (shared_tokens,), generator=generator).tolist()
    return [shared + torch.randint(FIRST_ORDINARY_ID, LAST_ORDINARY_ID, (SUFFIX_TOKENS,), generator=generator).tolist()
            for _ in range(count)]


async def one(http: httpx.AsyncClient, prompt: list[int]) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    start, ttft, token_ids, request_id = time.perf_counter(), None, [], ""
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            request_id = chunk["id"]
            for choice in chunk["choices"]:
                if choice.get("token_ids") and ttft is None:
                    ttft = time.perf_counter() - start
                token_ids += choice.get("token_ids") or []
    for _ in range(20):  # the ingress records the finish just after the last chunk
        record = (await http.get(f"/admin/ledger/{request_id}")).json()
        if record.get("status") != "in_flight":
            break
        await asyncio.sleep(0.1)
    handoff = record.get("handoff") or {}
    return {"ttft_s": ttft, "token_ids": token_ids, "kv_bytes": handoff.get("kv_bytes") or 0,
            "cached_bytes": handoff.get("cached_bytes") or 0, "fallback": handoff.get("fallback")}


def prefill_counters(url: str) -> tuple[int, int]:
    stats = httpx.get(f"{url}/admin/stats", timeout=30).json()
    prefill = [s for name, s in stats.items() if "/Prefill#" in name]
    return (sum(s["prefix_cache_queried_tokens"] for s in prefill), sum(s["prefix_cache_hit_tokens"] for s in prefill))


async def run_setting(url: str, batch: list[list[int]]) -> list[dict]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        await one(http, batch[0])  # warm-up: it fills the caches
        return [await one(http, prompt) for prompt in batch[1:]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shared-tokens", type=int, default=1024)
    parser.add_argument("--requests", type=int, default=16, help="timed requests per setting")
    parser.add_argument("--out", type=Path, default=DOCS_DIR, help="where PREFIX.md goes")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where prefix.json goes")
    args = parser.parse_args(argv)

    from benchmarks.local_serve import LocalServe  # noqa: PLC0415

    batch = prompts(args.shared_tokens, args.requests + 1)
    block_bytes = 4 * 2 * 16 * 2 * 64 * 4  # qwen3-tiny: layers x K/V x block tokens x kv heads x head dim x fp32
    prompt_kv_bytes = -(-len(batch[0]) // 16) * block_bytes
    started, results = time.perf_counter(), {}
    with LocalServe() as local:
        for setting, enabled in (("on", True), ("off", False)):
            url = local.deploy(f"prefix-{setting}", {"model": MODEL, "ledger_journal": None,
                                                     "engine": {"enable_prefix_caching": enabled}})
            before = prefill_counters(url)
            samples = asyncio.run(run_setting(url, batch))
            after = prefill_counters(url)
            local.delete(f"prefix-{setting}")
            queried, hit = after[0] - before[0], after[1] - before[1]
            ttfts = [s["ttft_s"] for s in samples]
            results[setting] = {
                "ttft_p50_ms": statistics.median(ttfts) * 1e3, "ttft_p90_ms": sorted(ttfts)[int(0.9 * len(ttfts))] * 1e3,
                "prefill_hit_rate": hit / queried if queried else None,
                "kv_moved_bytes": statistics.mean(s["kv_bytes"] for s in samples),
                "kv_cached_bytes": statistics.mean(s["cached_bytes"] for s in samples),
                "fallbacks": sum(1 for s in samples if s["fallback"]),
                "token_ids": [s["token_ids"] for s in samples],
            }
            r = results[setting]
            print(f"prefix caching {setting:>3}: TTFT p50 {r['ttft_p50_ms']:.1f} ms p90 {r['ttft_p90_ms']:.1f} ms, "
                  f"prefill hit rate {r['prefill_hit_rate'] or 0:.2f}, KV moved {r['kv_moved_bytes'] / 2**20:.2f} MiB, "
                  f"held by decode {r['kv_cached_bytes'] / 2**20:.2f} MiB per request", flush=True)
    same = results["on"]["token_ids"] == results["off"]["token_ids"]
    write_report(args, results, same, prompt_kv_bytes, time.perf_counter() - started)


def write_report(args, results: dict, same: bool, prompt_kv_bytes: int, total_s: float) -> None:
    m = machine()
    on, off = results["on"], results["off"]
    summary = {k: {key: v for key, v in r.items() if key != "token_ids"} for k, r in results.items()}
    args.out.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    raw_path = args.results / "prefix.json"
    raw_path.write_text(json.dumps({"machine": m, "shared_tokens": args.shared_tokens,
                                    "suffix_tokens": SUFFIX_TOKENS, "requests": args.requests,
                                    "results": summary, "same_tokens": same}, indent=1) + "\n")

    def row(name: str, r: dict) -> str:
        rate = "—" if r["prefill_hit_rate"] is None else f"{r['prefill_hit_rate']:.1%}"
        return (f"| {name} | {r['ttft_p50_ms']:.1f} | {r['ttft_p90_ms']:.1f} | {rate} | "
                f"{r['kv_moved_bytes'] / 2**20:.2f} | {r['kv_cached_bytes'] / 2**20:.2f} | {r['fallbacks']} |")

    path = args.out / "PREFIX.md"
    notes = kept_notes(path)
    lines = [
        "# Automatic prefix caching, P/D over HTTP", "",
        f"`make bench-prefix` (`benchmarks/prefix_cache.py`) on {time.strftime('%Y-%m-%d')}, {total_s:.0f} s. "
        f"Machine: {m['cpu_model']}, {m['nproc']} cores. Raw figures: [prefix.json]({link(raw_path, args.out)}).", "",
        f"One P/D app (shm transport, configs/cluster.yaml's replica options) per setting; {args.requests} requests "
        f"one at a time after a warm-up, each a shared {args.shared_tokens}-token prefix plus {SUFFIX_TOKENS} "
        f"tokens of its own ({prompt_kv_bytes / 2**20:.2f} MiB of KV per prompt), {MAX_TOKENS} tokens out, greedy.",
        "", "| prefix caching | TTFT p50 ms | TTFT p90 ms | prefill hit rate | KV moved MiB / request "
        "| KV decode already held MiB / request | fallbacks |", "|---|---:|---:|---:|---:|---:|---:|",
        row("on (default)", on), row("off", off), "",
        f"**TTFT on / off: {on['ttft_p50_ms'] / off['ttft_p50_ms']:.2f}x**; KV moved per request "
        f"{on['kv_moved_bytes'] / 2**20:.2f} MiB instead of {off['kv_moved_bytes'] / 2**20:.2f} "
        f"({1 - on['kv_moved_bytes'] / off['kv_moved_bytes']:.0%} saved); "
        f"tokens identical on and off: **{same}**.", "",
        "## Notes", "", notes, "",
    ]  # fmt: skip
    path.write_text("\n".join(lines))
    print("\n".join(lines[:12]))


if __name__ == "__main__":
    main()
