"""Soak: mixed traffic at a fixed concurrency for a fixed time against a running pegaserve.

    python -m loadtests.soak --url http://127.0.0.1:8000 --concurrency 32 --minutes 10

Passes when no request failed (every answer is checked against docs/contract.md with
`pegaserve.testing.contract`, as the load test does), the ledger counts no invariant violation,
every sampled answer agrees with its ledger record, and no Serve replica's memory grew by 10% or
more between the end of the warm-up and the end of the run. Only talks to 127.0.0.1; every loop is
bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import psutil

from pegaserve.testing.contract import (
    Answer,
    Params,
    answer_from_body,
    answer_from_sse,
    check_answer,
    check_ledger,
    ledger_keys,
)

PROMPTS = ["Hello world", "The quick brown fox", "Once upon a time in a land far away", "1, 2, 3, 4,",
           "Write a haiku about the sea", "def fibonacci(n):", "Q: What is Ray Serve?\nA:"]
MAX_REQUEST_S = 120
CHAT_PATH = "/v1/chat/completions"


@dataclass
class Tally:
    ok: int = 0
    failed: int = 0
    completion_tokens: int = 0
    checked_against_ledger: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(why)


def mixed_body(rng: random.Random) -> tuple[str, dict]:
    chat = rng.random() < 0.4
    body: dict = {"max_tokens": rng.randint(1, 48), "temperature": rng.choice([0.0, 0.7, 1.0]),
                  "stream": rng.random() < 0.5}
    body.update(rng.choice([{}, {"stop": [" the", "a"]}, {"stop_token_ids": [11, 13, 198]}, {"ignore_eos": True},
                            {"min_tokens": 1}, {"seed": rng.randint(0, 1000)}]))
    if body["stream"]:
        body["stream_options"] = {"include_usage": True}
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        return CHAT_PATH, body
    body["prompt"] = rng.choice(PROMPTS)
    if rng.random() < 0.3:
        body["logprobs"] = 2
    return "/v1/completions", body


class ContractBroken(Exception):
    """An answer broke the contract; the message lists what broke."""


async def one(client: httpx.AsyncClient, path: str, body: dict) -> Answer:
    """The answer, read whole (a stream to its `[DONE]`) and checked against docs/contract.md —
    raises on any transport or HTTP failure and on any broken rule."""
    chat = path == CHAT_PATH
    if body["stream"]:
        async with client.stream("POST", path, json=body) as response:
            response.raise_for_status()
            lines = [line async for line in response.aiter_lines() if line]
        answer = answer_from_sse(lines, chat)
    else:
        response = await client.post(path, json=body)
        response.raise_for_status()
        answer = answer_from_body(response.json(), chat)
    _raise_on(check_answer(answer, Params.from_body(body, chat)))
    return answer


async def check_against_ledger(client: httpx.AsyncClient, answer: Answer) -> None:
    """Rule 20: the ledger records of the answer's choices agree with it."""
    records = []
    for key in ledger_keys(answer):
        response = await client.get(f"/admin/ledger/{key}")
        records.append(response.json() if response.status_code == 200 else None)
    _raise_on(check_ledger(answer, records))


def _raise_on(problems: list[str]) -> None:
    if problems:
        raise ContractBroken("; ".join(problems))


async def worker(client: httpx.AsyncClient, deadline: float, rng: random.Random, tally: Tally) -> None:
    while time.monotonic() < deadline:
        path, body = mixed_body(rng)
        try:
            answer = await asyncio.wait_for(one(client, path, body), MAX_REQUEST_S)
            if rng.random() < 0.2:
                await check_against_ledger(client, answer)
                tally.checked_against_ledger += 1
        except Exception as exc:  # every failure is counted and reported, none stops the soak
            tally.fail(f"{path} {type(exc).__name__}: {exc}")
            continue
        tally.ok += 1
        tally.completion_tokens += answer.usage.completion_tokens  # checked: every soak answer has usage


def replica_memory() -> dict[int, tuple[str, int]]:
    """RSS of this machine's Serve replica processes, by pid."""
    out = {}
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "ServeReplica:" in cmd:
            try:
                out[proc.info["pid"]] = (cmd.split("ServeReplica:")[1].split()[0], proc.memory_info().rss)
            except psutil.Error:
                pass
    return out


async def soak(url: str, concurrency: int, seconds: float, warmup_s: float) -> int:
    host = urlparse(url).hostname
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"soak only targets this machine, not {host}")
    tally = Tally()
    async with httpx.AsyncClient(base_url=url, timeout=MAX_REQUEST_S) as client:
        await asyncio.gather(*(worker(client, time.monotonic() + warmup_s, random.Random(-i), Tally())
                               for i in range(concurrency)))
        memory_before = replica_memory()
        start = time.monotonic()
        await asyncio.gather(*(worker(client, start + seconds, random.Random(i), tally) for i in range(concurrency)))
        elapsed = time.monotonic() - start
        summary = (await client.get("/admin/ledger")).json()
    memory_after = replica_memory()
    growth = {name: (memory_after[pid][1] - rss) / rss for pid, (name, rss) in memory_before.items()
              if pid in memory_after}
    report = {
        "url": url, "concurrency": concurrency, "seconds": round(elapsed, 1), "requests_ok": tally.ok,
        "requests_failed": tally.failed, "completion_tokens_per_s": round(tally.completion_tokens / elapsed, 1),
        "requests_checked_against_ledger": tally.checked_against_ledger,
        "ledger_invariant_violations": summary["invariant_violations"],
        "replica_memory_growth": {name: f"{g:+.1%}" for name, g in growth.items()},
        "failures": tally.failures,
    }
    print(json.dumps(report, indent=2))
    passed = (tally.failed == 0 and tally.ok > 0 and summary["invariant_violations"] == 0
              and bool(growth) and all(g < 0.10 for g in growth.values()))
    print("SOAK PASSED" if passed else "SOAK FAILED")
    return 0 if passed else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup-seconds", type=float, default=30.0)
    args = parser.parse_args()
    sys.exit(asyncio.run(soak(args.url, args.concurrency, args.minutes * 60, args.warmup_seconds)))


if __name__ == "__main__":
    main()
