"""`make bench-kv`: the KV handoff per CPU transport, and TTFT of P/D against colocated.

For each transport (shm, gloo, object_store) a P/D app is deployed on an in-process Ray cluster
(127.0.0.1) and sent prompts of 128, 512 and 2048 tokens, one request at a time (streaming, 4 new
tokens, greedy, EOS ignored); each request's ledger record gives the KV bytes moved and decode's
seconds from claim to KV in hand. The raw send/recv bandwidth of the same transport for the same
byte counts is measured between two plain Ray actors (`benchmarks.kv.transport`); shm, which has
no transport of its own to time, is held against raw gloo (what it replaces on one node). A colocated app gets the
same prompts, for TTFT. P/D sends its first token from prefill, before any KV moves, so the
handoff shows in the time to the *second* token; both are reported.

Writes benchmarks/results/kv.json and docs/bench/KV.md.

    python -m benchmarks.kv [--lengths 128,512,2048] [--repeats 10] [--transports shm,gloo,object_store]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from pathlib import Path

import httpx
import torch

from benchmarks.kv.report import write_kv_report
from benchmarks.reports import DOCS_DIR, RESULTS_DIR
from pegaserve.pd.transports import native

TRANSPORTS = ("shm", "gloo", "object_store")
RAW_OF = {"shm": "gloo"}  # the raw transport a handoff is held against
LENGTHS = (128, 512, 2048)
REPEATS = 10
MAX_TOKENS = 4
MODEL = "qwen3-tiny"
SEED = 4321
FIRST_ORDINARY_ID, LAST_ORDINARY_ID = 100, 150_000  # clear of the special ids (151643+)
REQUEST_TIMEOUT_S = 60.0


@dataclasses.dataclass
class Sample:
    """One request: client-side times and, for P/D, its ledger handoff."""

    prompt_tokens: int
    ttft_s: float
    second_token_s: float | None
    e2e_s: float
    kv_bytes: int | None = None
    handoff_s: float | None = None
    fallback: str | None = None
    pushed: bool = False  # gloo: prefill sent the KV before decode asked (pegaserve/pd/push.py)


def make_prompt(num_tokens: int, index: int) -> list[int]:
    generator = torch.Generator().manual_seed(SEED + 7919 * num_tokens + index)
    return torch.randint(FIRST_ORDINARY_ID, LAST_ORDINARY_ID, (num_tokens,), generator=generator).tolist()


async def _stream_one(http: httpx.AsyncClient, prompt: list[int]) -> tuple[str, float, float | None, float]:
    """(request id, TTFT, time to second token, end-to-end), from the raw SSE stream."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    token_times: list[float] = []
    request_id = ""
    start = time.perf_counter()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            request_id = chunk["id"]
            for choice in chunk.get("choices", []):
                now = time.perf_counter()
                token_times += [now] * len(choice.get("token_ids") or ())
    end = time.perf_counter()
    if not token_times:
        raise RuntimeError(f"request {request_id} streamed no tokens")
    second = token_times[1] - start if len(token_times) > 1 else None
    return request_id, token_times[0] - start, second, end - start


async def run_prompts(url: str, lengths: list[int], repeats: int, read_ledger: bool) -> dict[int, list[Sample]]:
    """Per length: one untimed warm-up, then `repeats` requests, one at a time."""
    samples: dict[int, list[Sample]] = {}
    async with httpx.AsyncClient(base_url=url, timeout=REQUEST_TIMEOUT_S) as http:
        for length in lengths:
            await _stream_one(http, make_prompt(length, -1))
            samples[length] = []
            for i in range(repeats):
                request_id, ttft, second, e2e = await _stream_one(http, make_prompt(length, i))
                sample = Sample(length, ttft, second, e2e)
                if read_ledger:
                    _add_handoff(sample, await _ledger(http, request_id))
                samples[length].append(sample)
    return samples


async def _ledger(http: httpx.AsyncClient, request_id: str) -> dict:
    """The finished record (the ingress records the finish just after the last chunk)."""
    for _ in range(20):
        record = (await http.get(f"/admin/ledger/{request_id}")).json()
        if record.get("status") != "in_flight" and record.get("handoff"):
            return record
        await asyncio.sleep(0.1)
    return record


def _add_handoff(sample: Sample, record: dict) -> None:
    handoff = record.get("handoff") or {}
    sample.kv_bytes = handoff.get("kv_bytes")
    sample.handoff_s = handoff.get("seconds")
    sample.fallback = handoff.get("fallback")
    sample.pushed = bool(handoff.get("pushed"))


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="prompt lengths in tokens")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timed requests per length and app")
    parser.add_argument("--transports", default=",".join(TRANSPORTS), help="the P/D apps' transports")
    parser.add_argument("--no-colocated", action="store_true", help="skip the colocated app (no TTFT comparison)")
    parser.add_argument("--out", type=Path, default=DOCS_DIR, help="where KV.md goes")
    parser.add_argument("--results", type=Path, default=RESULTS_DIR, help="where kv.json goes")
    args = parser.parse_args(argv)

    from benchmarks.kv.transport import raw_bandwidth  # noqa: PLC0415
    from benchmarks.local_serve import LocalServe  # noqa: PLC0415

    lengths = [int(n) for n in args.lengths.split(",")]
    transports = args.transports.split(",")
    started = time.perf_counter()
    apps: dict[str, dict[int, list[Sample]]] = {}
    raw: dict[str, list] = {}
    with LocalServe() as local:
        colocated = () if args.no_colocated else (("colocated", "colocated", "gloo"),)
        for name, mode, transport in (*((f"pd-{t}", "pd", t) for t in transports), *colocated):
            url = local.deploy(name, {"model": MODEL, "mode": mode, "transport": transport, "ledger_journal": None})
            apps[name] = asyncio.run(run_prompts(url, lengths, args.repeats, read_ledger=mode == "pd"))
            local.delete(name)
            _print_app(name, apps[name])
        for transport in sorted({RAW_OF.get(t, t) for t in transports}):
            sizes = sorted({s.kv_bytes for t in transports if RAW_OF.get(t, t) == transport
                            for samples in apps[f"pd-{t}"].values() for s in samples if s.kv_bytes})
            raw[transport] = raw_bandwidth(transport, sizes)
            for figure in raw[transport]:
                print(f"raw {transport} ({figure.payload}, {figure.pattern}): {figure.num_bytes / 2**20:.2f} MiB in "
                      f"{figure.median_s * 1e3:.2f} ms = "
                      f"{figure.gb_per_s:.2f} GB/s", flush=True)  # fmt: skip
    total_s = time.perf_counter() - started
    result = {
        "settings": {"lengths": lengths, "repeats": args.repeats, "max_tokens": MAX_TOKENS, "model": MODEL,
                     "total_s": total_s, "native_handoff": native.module() is not None},
        "apps": {name: {str(n): [dataclasses.asdict(s) for s in samples] for n, samples in by_length.items()}
                 for name, by_length in apps.items()},
        "raw": {t: [{**dataclasses.asdict(f), "gb_per_s": f.gb_per_s} for f in figures] for t, figures in raw.items()},
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "kv.json").write_text(json.dumps(result, indent=1) + "\n")
    write_kv_report(result, args.out / "KV.md", args.results / "kv.json")
    print(f"bench-kv done in {total_s:.0f}s: {args.out / 'KV.md'}", flush=True)


def _print_app(name: str, by_length: dict[int, list[Sample]]) -> None:
    for length, samples in by_length.items():
        kv = median([s.kv_bytes for s in samples])
        handoff = median([s.handoff_s for s in samples])
        print(f"{name:<16} {length:>5} tokens: TTFT {median([s.ttft_s for s in samples]) * 1e3:7.1f} ms, "
              f"2nd token {(median([s.second_token_s for s in samples]) or 0) * 1e3:7.1f} ms"
              + (f", KV {kv / 2**20:.2f} MiB in {handoff * 1e3:.1f} ms" if kv and handoff else ""), flush=True)


if __name__ == "__main__":
    main()
