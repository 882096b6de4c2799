"""The ingress's own Python per output token: pegaserve's OpenAI app, in this process, with no Ray,
no engine and no socket.

The app (FastAPI, the guards, the frontend: stop strings, incremental detokenizing, the ledger,
the SSE chunks) is driven through ASGI directly: a scripted engine client gives every running
request one token per "step", the ASGI `send` only counts what it is handed. What that costs is
the part of the ingress's CPU that pegaserve's own code decides; the rest of an ingress replica's
CPU under `make serve` (Serve's HTTP and handle-call machinery, uvicorn's socket writes, Ray's
threads) is measured by `make bench-peers`' per-process meter. Two output lengths split the cost
into per request and per token. A benchmark, not a test: it asserts nothing about speed.

Usage: ``python -m benchmarks.ingress [--model DIR] [--requests N] [--concurrency C] [--profile]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import random
import time
from collections.abc import AsyncIterator

from pegaserve.api.app import build_app
from pegaserve.api.frontend import Frontend
from pegaserve.api.model_info import model_info, served_name
from pegaserve.api.services import EngineClient, LocalLedgerClient
from pegaserve.messages import EngineRequest, SampledToken, StepOutput
from pegaserve.models.config import ModelConfig
from pegaserve.models.tiny import DEFAULT_MODEL_NAME, ensure_model_dir
from pegaserve.stop import Length
from pegaserve.tokenizer import Tokenizer

OUTPUT_LENGTHS = (16, 128)
PROMPT = "The quick brown fox jumps over the lazy dog. " * 12  # ~120 tokens
FIRST_ORDINARY_ID, LAST_ORDINARY_ID = 100, 150_000


class ScriptedClient(EngineClient):
    """One token per running request per step, random ordinary ids, `Length` at `max_tokens`."""

    def __init__(self) -> None:
        self._running: dict[str, tuple[asyncio.Queue, list[int]]] = {}
        self._rng = random.Random(0)

    async def generate(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        choice_id = request.choice_id(0)
        queue: asyncio.Queue = asyncio.Queue()
        self._running[choice_id] = (queue, [request.policy.max_tokens])
        try:
            while (output := await queue.get()).finish is None:
                yield output
            yield output
        finally:
            self._running.pop(choice_id, None)

    def abort(self, choice_id: str) -> None:
        self._running.pop(choice_id, None)

    async def step_forever(self) -> None:
        while True:
            for choice_id, (queue, left) in list(self._running.items()):
                left[0] -= 1
                token = SampledToken(self._rng.randint(FIRST_ORDINARY_ID, LAST_ORDINARY_ID), -1.0)
                queue.put_nowait(StepOutput(choice_id, (token,), Length() if left[0] == 0 else None))
            await asyncio.sleep(0)


async def _post(app, body: bytes) -> int:
    """One streaming request through the ASGI app; the number of body messages it sent."""
    received = False

    async def receive() -> dict:
        nonlocal received
        if not received:
            received = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects

    messages = 0

    async def send(message: dict) -> None:
        nonlocal messages
        messages += message["type"] == "http.response.body"

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    await app(scope, receive, send)
    return messages


async def _run(app, model: str, num_requests: int, concurrency: int, max_tokens: int,
               profile: cProfile.Profile | None) -> float:
    """CPU-seconds of `num_requests` streaming requests, `concurrency` at a time."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True, "stream_options": {"include_usage": True}}).encode()
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            messages = await _post(app, body)
        if messages < max_tokens:  # a refusal, not a stream: nothing worth timing
            raise RuntimeError(f"a request sent {messages} body messages for {max_tokens} tokens")

    await asyncio.gather(*(one() for _ in range(concurrency)))  # warm-up
    start = time.process_time()
    if profile is not None:
        profile.enable()
    await asyncio.gather(*(one() for _ in range(num_requests)))
    if profile is not None:
        profile.disable()
    return time.process_time() - start


async def measure(model_dir: str, num_requests: int, concurrency: int, profile: bool) -> dict:
    tokenizer = Tokenizer(model_dir)
    info = model_info(served_name(DEFAULT_MODEL_NAME), ModelConfig.from_dir(model_dir), None)
    client = ScriptedClient()
    app = build_app(Frontend(client, tokenizer, info, LocalLedgerClient()), echo_request_id=False)
    stepper = asyncio.ensure_future(client.step_forever())
    profiler = cProfile.Profile() if profile else None
    try:
        cpu_s = {n: await _run(app, info.name, num_requests, concurrency, n,
                               profiler if n == max(OUTPUT_LENGTHS) else None)
                 for n in OUTPUT_LENGTHS}
    finally:
        stepper.cancel()
    short, long = OUTPUT_LENGTHS
    per_token_s = (cpu_s[long] - cpu_s[short]) / (num_requests * (long - short))
    per_request_s = cpu_s[short] / num_requests - short * per_token_s
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return {"requests": num_requests, "concurrency": concurrency, "cpu_s": cpu_s,
            "per_token_ms": per_token_s * 1e3, "per_request_ms": per_request_s * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="its tokenizer is used (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions (the long run)")
    args = parser.parse_args()
    result = asyncio.run(measure(str(ensure_model_dir(args.model)), args.requests, args.concurrency, args.profile))
    short, long = OUTPUT_LENGTHS
    print(f"{args.requests} streaming requests at concurrency {args.concurrency}, {short} and {long} tokens each: "
          f"{result['cpu_s'][short]:.2f} / {result['cpu_s'][long]:.2f} CPU-s")
    print(f"pegaserve's app, in process: {result['per_token_ms']:.3f} CPU-ms per output token "
          f"+ {result['per_request_ms']:.2f} CPU-ms per request")


if __name__ == "__main__":
    main()
