"""The stand-in server of `make bench-floor`: `POST /v1/completions` answers `max_tokens` tokens of
one fixed text, one every `STEP_S`, streamed as OpenAI completion chunks (or whole, unstreamed).
No model, no tokenizer: what it costs is the HTTP stack's own.

    python -m uvicorn benchmarks.floor.app:app               # plain uvicorn
    serve run benchmarks/floor/floor.yaml                    # the same app as a Serve deployment
    serve run benchmarks/floor/floor-pd.yaml                 # ... making P/D's two Serve calls a request
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

STEP_S = 0.03  # about a decode step of qwen3-tiny at concurrency 16 on 2 cores
TOKEN_TEXT = " token"

app = FastAPI()


class StepClock:
    """One timer for every running stream: each tick wakes all of them, as one engine step's frame
    wakes every request the ingress streams."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self._queues: set[asyncio.Queue] = set()
        self._ticker: asyncio.Task | None = None

    async def steps(self, num_steps: int):
        if self._ticker is None:
            self._ticker = asyncio.ensure_future(self._tick_forever())
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.add(queue)
        try:
            for step in range(num_steps):
                await queue.get()
                yield step
        finally:
            self._queues.discard(queue)

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            for queue in self._queues:
                queue.put_nowait(None)


clock = StepClock(STEP_S)


@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    num_tokens = int(body.get("max_tokens") or 16)
    head = {"id": "cmpl-floor", "object": "text_completion", "created": int(time.time()), "model": body.get("model")}
    calls = getattr(request.app.state, "calls", None)
    held = None if calls is None else await calls.start(num_tokens * STEP_S)
    if not body.get("stream"):
        async for _ in clock.steps(num_tokens):
            pass
        if held is not None:
            await held
        choice = {"index": 0, "text": TOKEN_TEXT * num_tokens, "logprobs": None, "finish_reason": "length"}
        return {**head, "choices": [choice]}

    async def chunks():
        async for step in clock.steps(num_tokens):
            finish = "length" if step == num_tokens - 1 else None
            choice = {"index": 0, "text": TOKEN_TEXT, "logprobs": None, "finish_reason": finish}
            yield f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"
        if held is not None:
            await held
        yield "data: [DONE]\n\n"

    return StreamingResponse(chunks(), media_type="text/event-stream")


class PdCalls:
    """P/D's Serve calls with nothing behind them: per request, one to a `Prefill` deployment that
    answers at once and one to a `Decode` deployment held open while the request streams, as
    pegaserve's ingress makes them (deployments/orchestration.py)."""

    def __init__(self, prefill, decode) -> None:
        self.prefill, self.decode = prefill, decode

    async def start(self, stream_s: float):
        """Prefill's call, answered; then decode's, returned unawaited (it returns after `stream_s`)."""
        await self.prefill.prefill.remote()
        return self.decode.generate.remote(stream_s)


def serve_app(args: dict | None = None):
    """The same app as a Serve deployment, with the Ingress's options of configs/cluster.yaml; with
    `pd_calls: true` in `args`, each request also makes P/D's two Serve calls (`PdCalls`), to
    deployments with the Prefill's and Decode's options."""
    from ray import serve  # noqa: PLC0415 - plain uvicorn runs without Ray

    @serve.deployment(name="Floor", max_ongoing_requests=256, max_queued_requests=512,
                      ray_actor_options={"num_cpus": 0.25})
    @serve.ingress(app)
    class Floor:
        def __init__(self, prefill=None, decode=None) -> None:
            app.state.calls = None if prefill is None else PdCalls(prefill, decode)

    if not (args or {}).get("pd_calls"):
        return Floor.bind()

    engine_options = {"max_ongoing_requests": 128, "max_queued_requests": 256, "ray_actor_options": {"num_cpus": 0.5}}

    @serve.deployment(name="Prefill", **engine_options)
    class Prefill:
        async def prefill(self) -> None:
            return None

    @serve.deployment(name="Decode", **engine_options)
    class Decode:
        async def generate(self, stream_s: float) -> None:
            await asyncio.sleep(stream_s)

    return Floor.bind(Prefill.bind(), Decode.bind())
