"""API keys, body size, admission control (429 + Retry-After) on the standalone app. Each app runs
on its own port (an engine serves one event loop)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pegaserve.api.app import build_app
from pegaserve.config import EngineConfig, Limits
from tests.api.helpers import PROMPT, scripted_frontend
from tests.contract.server import ThreadedServer

KEY = "sk-test-3f9a"


class client_for:  # noqa: N801 - used as `async with client_for(app) as c`, like httpx's own client
    """An async client of `app` served on a port of its own for the duration."""

    def __init__(self, app) -> None:
        self.server = ThreadedServer(app)

    async def __aenter__(self) -> httpx.AsyncClient:
        await asyncio.to_thread(self.server.__enter__)
        self.client = httpx.AsyncClient(base_url=self.server.base_url, timeout=120)
        return self.client

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()
        await asyncio.to_thread(self.server.__exit__)


@pytest.fixture
def server(tiny_model_dir):
    return scripted_frontend(tiny_model_dir, {})  # one per test: each test serves it on its own loop


def test_api_keys_guard_v1_and_admin_but_not_health(server, caplog):
    app = build_app(server, api_keys=(KEY,))

    async def run():
        async with client_for(app) as c:
            body = {"prompt": PROMPT, "max_tokens": 2}
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                r = await c.post("/v1/completions", json=body, headers=headers)
                assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            for path in ("/v1/models", "/admin/ledger"):
                assert (await c.get(path)).status_code == 401
                assert (await c.get(path, headers={"Authorization": f"Bearer {KEY}"})).status_code == 200
            for path, payload in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})):
                assert (await c.post(path, json=payload)).status_code == 401
                authorized = await c.post(path, json=payload, headers={"Authorization": f"Bearer {KEY}"})
                assert authorized.status_code == 200
            assert (await c.get("/health")).status_code == 200
            ok = await c.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})
            assert ok.status_code == 200
            record = (await c.get(f"/admin/ledger/{ok.json()['id']}", headers={"Authorization": f"Bearer {KEY}"}))
            assert KEY not in record.text

    asyncio.run(run())
    assert KEY not in caplog.text


def test_body_limit_is_413_and_whole_vocab_stop_set_fits_the_default(server):
    app = build_app(server)

    async def run():
        async with client_for(app) as c:
            whole_vocab = {"prompt": PROMPT, "max_tokens": 2, "stop_token_ids": list(range(151936))}
            assert len(json.dumps(whole_vocab)) > 1_000_000
            r = await c.post("/v1/completions", json=whole_vocab)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
            huge = {"prompt": "x" * (5 * 1024 * 1024)}
            r = await c.post("/v1/completions", json=huge)
            assert r.status_code == 413 and r.json()["error"]["message"]

    asyncio.run(run())


def test_limits_on_prompt_and_max_tokens(tiny_model_dir):
    limited = scripted_frontend(tiny_model_dir, {}, limits=Limits(max_prompt_tokens=4, max_tokens=8, max_stop_strings=2,
                                                                  max_choices=4, max_logit_bias=2))
    app = build_app(limited)

    async def run():
        async with client_for(app) as c:
            cases = [({"prompt": list(range(1, 10)), "max_tokens": 2}, "prompt"),
                     ({"prompt": PROMPT, "max_tokens": 9}, "max_tokens"),
                     ({"prompt": PROMPT, "max_tokens": 2, "stop": ["a", "b", "c"]}, "stop"),
                     ({"prompt": [PROMPT, PROMPT], "max_tokens": 2, "n": 3}, "n"),
                     ({"prompt": PROMPT, "max_tokens": 2, "logit_bias": {"1": 1, "2": 1, "3": 1}}, "logit_bias")]
            for body, param in cases:
                r = await c.post("/v1/completions", json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == param

    asyncio.run(run())


def test_overload_answers_429_with_retry_after(tiny_model_dir):
    # One running sequence, a waiting queue of one: the third concurrent request is refused by the
    # engine; max_inflight refuses at the door once 3 requests are in flight.
    busy = scripted_frontend(tiny_model_dir, {}, EngineConfig(max_num_seqs=1, max_queued_requests=1))
    app = build_app(busy, max_inflight=3)

    async def run():
        async with client_for(app) as c:
            body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True}
            responses = await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(6)))
            codes = sorted(r.status_code for r in responses)
            assert codes.count(200) >= 1 and 429 in codes and set(codes) <= {200, 429}, codes
            for r in responses:
                if r.status_code == 429:
                    assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error"
            again = await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert again.status_code == 200  # and it keeps serving

    asyncio.run(run())
