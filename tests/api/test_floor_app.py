"""`make bench-floor`'s stand-in server streams what the benchmark counts: one OpenAI completion
chunk per token, the last with `finish_reason: length`, then `[DONE]`; unstreamed, the whole text."""

from __future__ import annotations

import asyncio
import json

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
