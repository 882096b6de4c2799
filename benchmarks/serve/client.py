"""The benchmark's HTTP driver: streaming completions at a fixed concurrency, timed per chunk.

Uses the official `openai` client (`AsyncOpenAI`, `stream=True`), as users would. Each request
carries its prompt as token ids, `max_tokens` new tokens, greedy, `ignore_eos` (so every request
runs to `max_tokens`) and `return_token_ids` (so each chunk says how many tokens it carries).
A level sends `len(prompts)` requests through `concurrency` workers and stops handing out new
ones once its time budget is spent; every request has its own timeout.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from benchmarks.serve.stats import RequestTiming

REQUEST_TIMEOUT_S = 120.0


@dataclass
class LevelRun:
    """What one concurrency level produced (timings are `time.perf_counter()` seconds)."""

    concurrency: int
    timings: list[RequestTiming] = field(default_factory=list)
    wall_s: float = 0.0
    client_cpu_s: float = 0.0  # this process's CPU time during the level: the driver's own cost
    num_skipped: int = 0  # requests never sent because the level's time budget ran out


async def _one_request(client, model: str, prompt_ids: list[int], max_tokens: int) -> RequestTiming:
    timing = RequestTiming(num_prompt_tokens=len(prompt_ids), start_s=time.perf_counter())
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt_ids, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                timing.num_usage_tokens = chunk.usage.completion_tokens
            if chunk.choices:
                timing.request_id = chunk.id
                num_tokens = len((chunk.choices[0].model_extra or {}).get("token_ids") or ())
                if num_tokens:
                    timing.add_chunk(now, num_tokens)
    except Exception as exc:  # a failed request is counted, never fatal to the run
        timing.error = f"{type(exc).__name__}: {exc}"
    timing.end_s = time.perf_counter()
    return timing


async def run_level(url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int,
                    budget_s: float) -> LevelRun:
    """`prompts` through `concurrency` workers; no new request starts after `budget_s`."""
    from openai import AsyncOpenAI  # noqa: PLC0415

    run = LevelRun(concurrency)
    queue: asyncio.Queue[list[int]] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    start, cpu_start = time.perf_counter(), time.process_time()
    deadline = start + budget_s

    async def worker() -> None:
        while not queue.empty() and time.perf_counter() < deadline:
            prompt = queue.get_nowait()
            run.timings.append(await _one_request(client, model, prompt, max_tokens))

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.close()
    run.wall_s = time.perf_counter() - start
    run.client_cpu_s = time.process_time() - cpu_start
    run.num_skipped = queue.qsize()
    return run


async def warm_up(url: str, model: str, prompts: list[list[int]], max_tokens: int) -> None:
    """Untimed requests: opens the KV channels, fills torch's caches, loads the HTTP path."""
    run = await run_level(url, model, prompts, max_tokens, concurrency=len(prompts), budget_s=60.0)
    failed = [t.error for t in run.timings if t.error]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed[0]}")


async def read_ledger(url: str, request_ids: list[str], concurrency: int = 8) -> list[dict]:
    """The ledger records of `request_ids` (missing ones are skipped)."""
    import httpx  # noqa: PLC0415

    records: list[dict] = []
    semaphore = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:

        async def get(request_id: str) -> None:
            async with semaphore:
                response = await http.get(f"/admin/ledger/{request_id}")
                if response.status_code == 200:
                    records.append(response.json())

        await asyncio.gather(*(get(r) for r in request_ids))
    return records
