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


def mounted(app, prefix: str):
    """`app` under `prefix`, as a Serve route_prefix or a reverse proxy mounts it (root_path set)."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    return Starlette(routes=[Mount(prefix, app=app)])


@pytest.mark.parametrize("prefix", ["", "/llm"])
def test_keys_hold_wherever_the_app_is_mounted_and_cover_its_schema_and_docs(server, prefix):
    app = build_app(server, api_keys=(KEY,))
    outer = mounted(app, prefix) if prefix else app
    auth = {"Authorization": f"Bearer {KEY}"}

    async def run():
        async with client_for(outer) as c:
            body = {"prompt": PROMPT, "max_tokens": 2}
            assert (await c.post(f"{prefix}/v1/completions", json=body)).status_code == 401
            for path in ("/v1/models", "/admin/ledger", "/admin/stats", "/openapi.json", "/docs", "/redoc"):
                assert (await c.get(f"{prefix}{path}")).status_code == 401, path
            assert (await c.get(f"{prefix}/v1/models", headers=auth)).status_code == 200
            assert (await c.get(f"{prefix}/openapi.json", headers=auth)).status_code == 200
            assert (await c.post(f"{prefix}/v1/completions", json=body, headers=auth)).status_code == 200
            assert (await c.get(f"{prefix}/health")).status_code == 200

    asyncio.run(run())


def test_an_empty_key_in_the_list_admits_no_empty_token(server):
    app = build_app(server, api_keys=("", KEY))

    async def run():
        async with client_for(app) as c:
            for header in ("Bearer", "", "Basic x"):
                assert (await c.get("/v1/models", headers={"Authorization": header})).status_code == 401

    asyncio.run(run())


def test_only_json_bodies_are_served(server):
    app = build_app(server)

    async def run():
        async with client_for(app) as c:
            raw = json.dumps({"prompt": PROMPT, "max_tokens": 2})
            for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
                r = await c.post("/v1/completions", content=raw, headers={"content-type": content_type})
                assert r.status_code == 415 and r.json()["error"]["param"] == "content-type", content_type
            r = await c.post("/v1/completions", content=raw.encode(), headers={"content-type": ""})
            assert r.status_code == 415
            r = await c.post("/v1/completions", content=raw, headers={"content-type": "application/json; charset=utf-8"})
            assert r.status_code == 200

    asyncio.run(run())


def test_without_keys_only_the_allowed_hosts_are_served(server):
    async def run(app, host: str) -> int:
        async with client_for(app) as c:
            return (await c.get("/v1/models", headers={"host": host})).status_code

    app = build_app(server)
    for host in ("127.0.0.1:8000", "localhost", "[::1]:8000", "LOCALHOST:1"):
        assert asyncio.run(run(app, host)) == 200, host
    for host in ("attacker.example", "attacker.example:8000", "127.0.0.1.attacker.example"):
        assert asyncio.run(run(app, host)) == 400, host
    assert asyncio.run(run(build_app(server, allowed_hosts=("llm.internal",)), "llm.internal:80")) == 200
    assert asyncio.run(run(build_app(server, allowed_hosts=("*",)), "attacker.example")) == 200


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_fields_are_a_400_naming_them_unless_the_server_accepts_them(tiny_model_dir, endpoint):
    base = {"prompt": PROMPT} if endpoint == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}

    async def run(limits: Limits, body: dict) -> httpx.Response:
        async with client_for(build_app(scripted_frontend(tiny_model_dir, {}, limits=limits))) as c:
            return await c.post(endpoint, json={**base, "max_tokens": 2, **body})

    for field in ("temprature", "max_token"):
        r = asyncio.run(run(Limits(), {field: 1}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field
        assert f"Unrecognized request argument supplied: {field}" in r.json()["error"]["message"]
    if endpoint == "/v1/completions":  # implemented on chat only
        assert asyncio.run(run(Limits(), {"prediction": {"type": "content", "content": "x"}})).status_code == 400
    assert asyncio.run(run(Limits(refuse_unknown_fields=False), {"temprature": 0.1})).status_code == 200


def test_stored_objects_belong_to_the_key_that_stored_them(server):
    """OpenAI scopes stored chat completions and responses to a project: here, to an API key. Another
    key's objects are as unknown as missing ones, on every route."""
    other = "sk-test-other"
    app = build_app(server, api_keys=(KEY, other))
    mine, theirs = {"Authorization": f"Bearer {KEY}"}, {"Authorization": f"Bearer {other}"}

    async def run():
        async with client_for(app) as c:
            chat = await c.post("/v1/chat/completions", headers=mine, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "store": True})
            chat_id = chat.json()["id"]
            response = await c.post("/v1/responses", headers=mine, json={"input": "hi", "max_output_tokens": 2})
            response_id = response.json()["id"]
            assert (await c.get("/v1/chat/completions", headers=theirs)).json()["data"] == []
            assert [d["id"] for d in (await c.get("/v1/chat/completions", headers=mine)).json()["data"]] == [chat_id]
            for method, path, body in (("GET", f"/v1/chat/completions/{chat_id}", None),
                                       ("GET", f"/v1/chat/completions/{chat_id}/messages", None),
                                       ("POST", f"/v1/chat/completions/{chat_id}", {"metadata": {"k": "v"}}),
                                       ("DELETE", f"/v1/chat/completions/{chat_id}", None),
                                       ("GET", f"/v1/responses/{response_id}", None),
                                       ("GET", f"/v1/responses/{response_id}/input_items", None),
                                       ("DELETE", f"/v1/responses/{response_id}", None)):
                r = await c.request(method, path, json=body, headers=theirs)
                assert r.status_code == 404, (method, path, r.text)
            r = await c.post("/v1/responses", headers=theirs, json={
                "input": "more", "previous_response_id": response_id, "max_output_tokens": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
            assert (await c.get(f"/v1/chat/completions/{chat_id}/messages", headers=mine)).status_code == 200
            assert (await c.get(f"/v1/responses/{response_id}", headers=mine)).json()["id"] == response_id
            r = await c.post("/v1/responses", headers=mine, json={
                "input": "more", "previous_response_id": response_id, "max_output_tokens": 2})
            assert r.status_code == 200
            assert (await c.delete(f"/v1/chat/completions/{chat_id}", headers=mine)).json()["deleted"]

    asyncio.run(run())


def test_a_request_past_its_work_or_echo_budget_is_a_400_naming_it(tiny_model_dir):
    """A 1 MB message echoed in 128 choices would be a 128 MB answer; n times (prompt + max_tokens)
    can hold the KV cache for minutes: each has a budget (limits), and past it a 400 names it."""
    limits = Limits(max_request_tokens=1000, max_echo_bytes=64 << 10)
    app = build_app(scripted_frontend(tiny_model_dir, {}, limits=limits))
    big = "word " * 4000  # ~20 kB

    async def run():
        async with client_for(app) as c:
            chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": big}],
                    "add_generation_prompt": False, "continue_final_message": True, "echo": True, "n": 8,
                    "max_tokens": 1, "truncate_prompt_tokens": 8}  # the last message is echoed in each choice
            r = await c.post("/v1/chat/completions", json=chat)
            assert r.status_code == 400 and r.json()["error"]["param"] == "echo", r.text
            assert (await c.post("/v1/chat/completions", json={**chat, "n": 2})).status_code == 200
            r = await c.post("/v1/completions", json={"prompt": PROMPT, "n": 8, "max_tokens": 200})
            assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
            assert (await c.post("/v1/completions", json={"prompt": PROMPT, "n": 2, "max_tokens": 200})).status_code == 200

    asyncio.run(run())


def test_with_keys_the_prefix_cache_is_each_keys_own(server):
    """`cached_tokens` would tell one tenant what another's prompts held: with keys, each key's
    prompts are salted apart (the client's own salt after it), one key's repeat still hits."""
    other = "sk-test-other"
    app = build_app(server, api_keys=(KEY, other))
    prompt = "the same long shared prefix " * 8

    async def cached(c, key: str, **extra) -> int:
        r = await c.post("/v1/completions", headers={"Authorization": f"Bearer {key}"},
                         json={"prompt": prompt, "max_tokens": 1, **extra})
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    async def run():
        async with client_for(app) as c:
            assert await cached(c, KEY) == 0
            assert await cached(c, KEY) > 0  # the key's own repeat hits
            assert await cached(c, other) == 0  # another key's does not
            assert await cached(c, other, cache_salt="s") == 0 and await cached(c, other, cache_salt="s") > 0

    asyncio.run(run())


def test_admin_keys_alone_open_the_admin_routes(server):
    admin = "sk-admin-1"
    app = build_app(server, api_keys=(KEY,), admin_api_keys=(admin,))

    async def run():
        async with client_for(app) as c:
            for path in ("/admin/ledger", "/admin/stats"):
                assert (await c.get(path, headers={"Authorization": f"Bearer {KEY}"})).status_code == 401, path
                assert (await c.get(path, headers={"Authorization": f"Bearer {admin}"})).status_code == 200, path
            assert (await c.get("/v1/models", headers={"Authorization": f"Bearer {admin}"})).status_code == 401
            assert (await c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).status_code == 200

    asyncio.run(run())
