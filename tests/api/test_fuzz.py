"""Property-based fuzzing of the two generation endpoints: every answer is a 200 or a 4xx with an
OpenAI error body — never a 500 — and the server keeps serving."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pegaserve.api.app import build_app
from pegaserve.api.local import build_local_server

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
JSONISH = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
SMALL_INT = st.integers(min_value=-3, max_value=12)
TOKEN = st.integers(min_value=-5, max_value=151940)


def field(good, junk=JSONISH):
    return st.one_of(good, junk)


COMMON = {
    "model": field(st.sampled_from(["qwen3-tiny", "other"])),
    "max_tokens": field(SMALL_INT),
    "temperature": field(st.floats(min_value=-1, max_value=3)),
    "top_p": field(st.floats(min_value=-0.5, max_value=1.5)),
    "top_k": field(SMALL_INT),
    "seed": field(st.integers(min_value=-(2**64), max_value=2**64)),
    "stop": field(st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20))),
    "stop_token_ids": field(st.lists(TOKEN, max_size=8)),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(SMALL_INT),
    "include_stop_str_in_output": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "return_token_ids": field(st.booleans()),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "n": field(st.integers(min_value=0, max_value=3)),
}
COMPLETION = {**COMMON, "prompt": field(st.one_of(st.text(max_size=30), st.lists(TOKEN, max_size=12),
                                                  st.lists(st.lists(TOKEN, max_size=4), max_size=3))),
              "logprobs": field(st.integers(min_value=-2, max_value=25)), "echo": field(st.booleans())}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                 "content": st.one_of(st.text(max_size=30), JSONISH)})
CHAT = {**COMMON, "messages": field(st.lists(MESSAGE, max_size=3)), "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(min_value=-2, max_value=25)),
        "max_completion_tokens": field(SMALL_INT)}


def bodies(fields: dict) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional=fields)


HEADERS = st.dictionaries(
    st.sampled_from(["content-type", "authorization", "x-request-id", "accept"]),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30), max_size=3,
)


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    return build_app(build_local_server(script={}))


def check(app, path: str, body, headers: dict, raw: bytes | None = None) -> None:
    async def run():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
            content = raw if raw is not None else json.dumps(body).encode()
            send_headers = {"content-type": "application/json", **headers}
            response = await c.post(path, content=content, headers=send_headers)
            assert response.status_code < 500, (response.status_code, response.text, body)
            if response.status_code == 200:
                if response.headers["content-type"].startswith("text/event-stream"):
                    assert response.text.rstrip().endswith("data: [DONE]")
                    assert '"internal_server_error"' not in response.text, response.text
                else:
                    assert "choices" in response.json()
            else:
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"} and error["message"]
            assert (await c.get("/health")).status_code == 200

    asyncio.run(run())


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=bodies(COMPLETION), headers=HEADERS)
def test_fuzz_completions(app, body, headers):
    check(app, "/v1/completions", body, headers)


@FUZZ
@given(body=bodies(CHAT), headers=HEADERS)
def test_fuzz_chat(app, body, headers):
    check(app, "/v1/chat/completions", body, headers)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200), path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzz_raw_bytes(app, raw, path):
    check(app, path, None, {}, raw=raw)
