"""`make bench-floor`'s stand-in server streams what the benchmark counts: one OpenAI completion
chunk per token, the last with `finish_reason: length`, then `[DONE]`; unstreamed, the whole text."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import httpx

from benchmarks.floor import app as floor
from benchmarks.floor.run import split_per_request


def _post(body: dict) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=floor.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://floor") as client:
            return await client.post("/v1/completions", json=body)

    return asyncio.run(go())


def test_one_chunk_per_token_then_done(monkeypatch):
    monkeypatch.setattr(floor, "clock", floor.StepClock(0.001))
    response = _post({"model": "m", "prompt": [1, 2, 3], "max_tokens": 5, "stream": True})
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == [floor.TOKEN_TEXT] * 5
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 4 + ["length"]
    assert {c["object"] for c in chunks} == {"text_completion"}


def test_unstreamed_answer_holds_every_token(monkeypatch):
    monkeypatch.setattr(floor, "clock", floor.StepClock(0.001))
    choice = _post({"model": "m", "prompt": "hi", "max_tokens": 3}).json()["choices"][0]
    assert choice["text"] == floor.TOKEN_TEXT * 3 and choice["finish_reason"] == "length"


def _handle(calls: list, name: str, run) -> SimpleNamespace:
    """A Serve handle with one method `name`: `.remote(*args)` logs the call and runs `run(*args)`."""

    def remote(*args):
        calls.append((name, args))
        return asyncio.ensure_future(run(*args))

    return SimpleNamespace(**{name: SimpleNamespace(remote=remote)})


def test_pd_calls_make_two_calls_a_request_and_hold_the_second_to_the_end(monkeypatch):
    """floor-pd.yaml's stand-in makes P/D's Serve calls: prefill's, answered before any token, then
    decode's, for the stream's length, awaited before `[DONE]`."""
    monkeypatch.setattr(floor, "clock", floor.StepClock(0.001))
    calls: list = []
    ended: list = []

    async def prefill():
        return None

    async def generate(stream_s: float):
        await asyncio.sleep(0.01)
        ended.append(stream_s)

    floor.app.state.calls = floor.PdCalls(_handle(calls, "prefill", prefill), _handle(calls, "generate", generate))
    try:
        response = _post({"model": "m", "prompt": "hi", "max_tokens": 4, "stream": True})
    finally:
        floor.app.state.calls = None
    assert response.text.endswith("data: [DONE]\n\n")
    assert calls == [("prefill", ()), ("generate", (4 * floor.STEP_S,))]
    assert ended == [4 * floor.STEP_S]  # the held call ended before the answer did


def test_split_per_request_recovers_both_parts():
    """The split's arithmetic: two loads of 10 requests, 640 and 160 tokens, of a process that
    costs 2 ms a request and 0.1 ms a token (and the serving-path total, for a replica's label)."""
    def cpu_s(tokens: int) -> dict[str, float]:
        return {"ServeReplica:app:Ingress": (10 * 2.0 + tokens * 0.1) / 1e3}

    split = split_per_request(cpu_s(640), 640, cpu_s(160), 160, num_requests=10)
    for label in ("ServeReplica:app:Ingress", "kind:serving"):
        per_request_ms, per_token_ms = split[label]
        assert abs(per_request_ms - 2.0) < 1e-9 and abs(per_token_ms - 0.1) < 1e-9
    assert split["kind:engine"] == (0.0, 0.0)
