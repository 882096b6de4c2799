"""Property-based fuzzing of the three generation endpoints: every answer is a 200 or a 4xx with an
OpenAI error body — never a 500, never a NaN or an infinity in the JSON — and the server keeps
serving. Beside random bodies: an explicit null in any set of fields is the default (200), a lone
surrogate in any string field is a 400 naming it, extreme numbers in every numeric field are a 200
or a 400, and requests that share an X-Request-Id all run and are accounted apart."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pegaserve.api.app import build_app
from pegaserve.api.protocol import ChatCompletionRequest, CompletionRequest, ResponsesRequest
from pegaserve.config import Limits
from tests.api.helpers import PROMPT, raw_json, scripted_frontend
from tests.contract.server import ThreadedServer

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20),
)
JSONISH = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
SMALL_INT = st.integers(min_value=-3, max_value=12)
TOKEN = st.integers(min_value=-5, max_value=151940)
EXTREME_FLOATS = [0.0, -0.0, 5e-324, -5e-324, 1e-45, 1e-30, 1e-9, 9.99e-6, 1e-5, 1.0000001, 2.0000001, 1e30, -1e30,
                  1.7e308, -1.7e308, 2.0**63, -(2.0**63), 100.0, -100.0, 100.00001]
EXTREME_INTS = [0, -1, -2, 1, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 2**70, 10**30]


def field(good, junk=JSONISH):
    return st.one_of(good, junk)


COMMON = {
    "model": field(st.sampled_from(["qwen3-tiny", "other"])),
    "max_tokens": field(SMALL_INT),
    "temperature": field(st.one_of(st.floats(min_value=-1, max_value=3), st.sampled_from(EXTREME_FLOATS))),
    "top_p": field(st.floats(min_value=-0.5, max_value=1.5)),
    "top_k": field(SMALL_INT),
    "min_p": field(st.floats(min_value=-0.5, max_value=1.5)),
    "seed": field(st.integers(min_value=-(2**64), max_value=2**64)),
    "stop": field(st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=20))),
    "stop_token_ids": field(st.lists(TOKEN, max_size=8)),
    "ignore_eos": field(st.booleans()),
    "min_tokens": field(SMALL_INT),
    "include_stop_str_in_output": field(st.booleans()),
    "skip_special_tokens": field(st.booleans()),
    "return_token_ids": field(st.booleans()),
    "stream": field(st.booleans()),
    "stream_options": field(st.fixed_dictionaries({"include_usage": st.booleans()},
                                                  optional={"continuous_usage_stats": st.booleans()})),
    "n": field(st.integers(min_value=0, max_value=3)),
    "presence_penalty": field(st.floats(min_value=-3, max_value=3)),
    "frequency_penalty": field(st.floats(min_value=-3, max_value=3)),
    "repetition_penalty": field(st.floats(min_value=-0.5, max_value=2.5)),
    "logit_bias": field(st.dictionaries(st.one_of(TOKEN.map(str), st.text(max_size=4)),
                                        st.floats(min_value=-150, max_value=150), max_size=4)),
    "prompt_logprobs": field(st.integers(min_value=-2, max_value=25)),
    "echo": field(st.booleans()),
    "truncate_prompt_tokens": field(st.integers(min_value=-2, max_value=6)),
    "response_format": field(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})),
    "use_beam_search": field(st.booleans()),
    "length_penalty": field(st.floats(min_value=-2, max_value=3)),
    "priority": field(st.integers(min_value=-3, max_value=3)),
    "logprob_token_ids": field(st.lists(TOKEN, max_size=4)),
}
COMPLETION = {**COMMON, "prompt": field(st.one_of(st.text(max_size=30), st.lists(TOKEN, max_size=12),
                                                  st.lists(st.lists(TOKEN, max_size=4), max_size=3))),
              "logprobs": field(st.integers(min_value=-2, max_value=25)),
              "best_of": field(st.integers(min_value=-1, max_value=4))}
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                 "content": st.one_of(st.text(max_size=30), JSONISH)})
CHAT = {**COMMON, "messages": field(st.lists(MESSAGE, max_size=3)), "logprobs": field(st.booleans()),
        "top_logprobs": field(st.integers(min_value=-2, max_value=25)),
        "max_completion_tokens": field(SMALL_INT), "tool_choice": field(st.sampled_from(["none", "auto", "required"])),
        "service_tier": field(st.sampled_from(["auto", "flex"])), "store": field(st.booleans()),
        "prediction": field(st.fixed_dictionaries({"type": st.sampled_from(["content", "diff"]),
                                                   "content": st.one_of(st.text(max_size=20), JSONISH)})),
        "functions": field(st.lists(st.fixed_dictionaries({"name": st.text(max_size=6)}), max_size=2)),
        "function_call": field(st.one_of(st.sampled_from(["none", "auto"]),
                                         st.fixed_dictionaries({"name": st.text(max_size=6)}))),
        "documents": field(st.lists(st.dictionaries(st.text(max_size=5), st.text(max_size=5)), max_size=2)),
        "reasoning_effort": field(st.sampled_from(["low", "high", "extreme"])),
        "chat_template": field(st.text(max_size=30))}
ITEM = st.one_of(MESSAGE, JSONISH, st.fixed_dictionaries(
    {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"])},
    optional={"role": st.sampled_from(["user", "assistant", "tool"]), "call_id": st.text(max_size=4),
              "name": st.text(max_size=4), "arguments": st.text(max_size=8), "output": st.one_of(st.text(max_size=8),
                                                                                                 JSONISH),
              "content": st.one_of(st.text(max_size=8), st.lists(st.fixed_dictionaries(
                  {"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                   "text": st.text(max_size=8)}), max_size=2))}))
RESPONSES = {key: COMMON[key] for key in ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
                                          "stop_token_ids", "ignore_eos", "min_tokens", "stream", "presence_penalty",
                                          "frequency_penalty", "repetition_penalty", "logit_bias", "priority")}
RESPONSES |= {"input": field(st.one_of(st.text(max_size=30), st.lists(ITEM, max_size=3))),
              "instructions": field(st.text(max_size=20)), "max_output_tokens": field(SMALL_INT),
              "tools": field(st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("function"),
                                                                        "name": st.text(max_size=6)}), JSONISH),
                                      max_size=2)),
              "tool_choice": field(st.one_of(st.sampled_from(["none", "auto", "required"]),
                                             st.fixed_dictionaries({"type": st.just("function"),
                                                                    "name": st.text(max_size=6)}))),
              "text": field(st.fixed_dictionaries({}, optional={"format": st.fixed_dictionaries(
                  {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
                  optional={"schema": JSONISH, "name": st.text(max_size=4)}), "verbosity": JSONISH})),
              "reasoning": field(st.fixed_dictionaries({}, optional={"effort": st.sampled_from(["low", "x"]),
                                                                     "summary": JSONISH})),
              "store": field(st.booleans()), "include": field(st.lists(st.text(max_size=5), max_size=2)),
              "truncation": field(st.sampled_from(["disabled", "auto"])),
              "stream_options": field(st.fixed_dictionaries({"include_obfuscation": st.booleans()}))}


def bodies(fields: dict) -> st.SearchStrategy[dict]:
    return st.fixed_dictionaries({}, optional=fields)


HEADERS = st.dictionaries(
    st.sampled_from(["content-type", "authorization", "x-request-id", "accept", "host"]),
    st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30).map(str.strip), max_size=3,
)
MESSAGES = [{"role": "user", "content": "hi"}]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "responses": "/v1/responses"}
MODELS = {"completions": CompletionRequest, "chat": ChatCompletionRequest, "responses": ResponsesRequest}


def base_body(endpoint: str) -> dict:
    return {"completions": {"prompt": PROMPT}, "chat": {"messages": MESSAGES}, "responses": {"input": "hi"}}[endpoint]


def short(endpoint: str) -> dict:
    """Two tokens at most, in the endpoint's own words."""
    return {"max_output_tokens": 2} if endpoint == "responses" else {"max_tokens": 2}


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    """A server on a real port (the engine serves one event loop); max_tokens capped, so a default
    (null) max_tokens stays a short request."""
    with ThreadedServer(build_app(scripted_frontend(tiny_model_dir, {}, limits=Limits(max_tokens=16)))) as server:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            yield client


def _strict_json(text: str):
    def refuse(constant: str):
        raise AssertionError(f"{constant} in a response: {text[:300]}")

    return json.loads(text, parse_constant=refuse)


def check_response(response: httpx.Response, body) -> None:
    assert response.status_code < 500, (response.status_code, response.text, body)
    responses = response.request.url.path == "/v1/responses"
    if response.status_code == 200:
        if response.headers["content-type"].startswith("text/event-stream"):
            events = [_strict_json(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
            assert '"internal_server_error"' not in response.text, response.text
            if responses:  # OpenAI's framing: typed events, the last one the response, no [DONE]
                assert events[-1]["type"] in ("response.completed", "response.incomplete"), response.text
                assert [e["sequence_number"] for e in events] == list(range(len(events)))
            else:
                assert response.text.rstrip().endswith("data: [DONE]")
        else:
            assert ("output" if responses else "choices") in _strict_json(response.text)
    else:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert "Traceback" not in error["message"] and "/work/" not in error["message"]


def check(app: httpx.Client, path: str, body, headers: dict, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else raw_json(body)
    response = app.post(path, content=content, headers={"content-type": "application/json", **headers})
    check_response(response, body)
    assert app.get("/health").status_code == 200
    return response


FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
FEW = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(body=bodies(COMPLETION), headers=HEADERS)
def test_fuzz_completions(app, body, headers):
    check(app, "/v1/completions", body, headers)


@FUZZ
@given(body=bodies(CHAT), headers=HEADERS)
def test_fuzz_chat(app, body, headers):
    check(app, "/v1/chat/completions", body, headers)


@FUZZ
@given(body=bodies(RESPONSES), headers=HEADERS)
def test_fuzz_responses(app, body, headers):
    check(app, "/v1/responses", body, headers)


@FEW
@given(raw=st.binary(max_size=200), path=st.sampled_from(sorted(PATHS.values())))
def test_fuzz_raw_bytes(app, raw, path):
    check(app, path, None, {}, raw=raw)


# --- nulls: an explicit null is the default, in any set of fields --------------------------------


def optional_fields(endpoint: str) -> list[str]:
    return sorted(name for name, f in MODELS[endpoint].model_fields.items() if not f.is_required())


@FEW
@given(data=st.data(), endpoint=st.sampled_from(sorted(PATHS)), stream=st.booleans())
def test_fuzz_nulls_in_any_fields_are_the_defaults(app, data, endpoint, stream):
    nulls = data.draw(st.sets(st.sampled_from(optional_fields(endpoint)), min_size=1))
    body = {**base_body(endpoint), **dict.fromkeys(nulls), "stream": stream}
    response = check(app, PATHS[endpoint], body, {})
    assert response.status_code == 200, (response.text, sorted(nulls))


# --- lone surrogates: a 400 naming the field that holds one ------------------------------------------

# (field, how to put a string into a body of that endpoint)
STRING_FIELDS = {
    "completions": {
        "prompt": lambda s: {"prompt": s},
        "model": lambda s: {"model": s},
        "stop": lambda s: {"stop": ["ok", s]},
        "user": lambda s: {"user": s},
        "request_id": lambda s: {"request_id": s},
        "suffix": lambda s: {"suffix": s},
        "logit_bias": lambda s: {"logit_bias": {s: 1.0}},
        "cache_salt": lambda s: {"cache_salt": s},
        "bad_words": lambda s: {"bad_words": [s]},
    },
    "chat": {
        "messages": lambda s: {"messages": [{"role": "user", "content": s}]},
        "model": lambda s: {"model": s},
        "stop": lambda s: {"stop": s},
        "user": lambda s: {"user": s},
        "metadata": lambda s: {"metadata": {"k": s}},
        "chat_template_kwargs": lambda s: {"chat_template_kwargs": {s: 1}},
        "tool_choice": lambda s: {"tool_choice": s},
        "chat_template": lambda s: {"chat_template": s},
    },
    "responses": {
        "input": lambda s: {"input": [{"role": "user", "content": [{"type": "input_text", "text": s}]}]},
        "instructions": lambda s: {"instructions": s},
        "model": lambda s: {"model": s},
        "stop": lambda s: {"stop": [s]},
        "safety_identifier": lambda s: {"safety_identifier": s},
        "metadata": lambda s: {"metadata": {s: "v"}},
        "tools": lambda s: {"tools": [{"type": "function", "name": s}]},
    },
}
SURROGATES = st.sampled_from(["\ud800", "\udfff", "\udc80", "\ud83d"])


@FEW
@given(data=st.data(), endpoint=st.sampled_from(sorted(PATHS)), surrogate=SURROGATES, text=st.text(max_size=6))
def test_fuzz_lone_surrogates_are_a_400_naming_the_field(app, data, endpoint, surrogate, text):
    name = data.draw(st.sampled_from(sorted(STRING_FIELDS[endpoint])))
    cut = data.draw(st.integers(0, len(text)))
    value = text[:cut] + surrogate + text[cut:]
    body = {**base_body(endpoint), **short(endpoint), **STRING_FIELDS[endpoint][name](value)}
    response = check(app, PATHS[endpoint], body, {})
    assert response.status_code == 400 and response.json()["error"]["param"] == name, (name, response.text)


# --- extreme numbers: 200 or 400, finite JSON ------------------------------------------------------

FLOAT_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "length_penalty"]
INT_FIELDS = {"completions": ["max_tokens", "top_k", "seed", "n", "min_tokens", "logprobs", "prompt_logprobs",
                              "truncate_prompt_tokens", "best_of", "priority"],
              "chat": ["max_tokens", "max_completion_tokens", "top_k", "seed", "n", "min_tokens", "top_logprobs",
                       "prompt_logprobs", "truncate_prompt_tokens", "priority"],
              "responses": ["max_output_tokens", "top_k", "seed", "min_tokens", "priority", "top_logprobs"]}


@FEW
@given(data=st.data(), endpoint=st.sampled_from(sorted(PATHS)), stream=st.booleans())
def test_fuzz_extreme_numbers_are_a_200_or_a_400(app, data, endpoint, stream):
    numbers = data.draw(st.dictionaries(st.sampled_from(FLOAT_FIELDS), st.sampled_from(EXTREME_FLOATS), min_size=1))
    numbers |= data.draw(st.dictionaries(st.sampled_from(INT_FIELDS[endpoint]), st.sampled_from(EXTREME_INTS)))
    bias = data.draw(st.sampled_from([None, *EXTREME_FLOATS]))
    body = {**base_body(endpoint), "max_tokens": 3, **numbers, "stream": stream}
    if bias is not None:
        body["logit_bias"] = {"64": bias}
    if endpoint == "completions":
        body.setdefault("logprobs", 2)
    else:
        body["logprobs"] = True
    check(app, PATHS[endpoint], body, {})


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("name", ["temperature", "top_p", "min_p", "presence_penalty", "repetition_penalty"])
def test_non_finite_numbers_are_a_400_naming_the_field(app, name, literal):
    raw = ('{"prompt": [1, 2, 3], "max_tokens": 2, "%s": %s}' % (name, literal)).encode()
    response = check(app, "/v1/completions", None, {}, raw=raw)
    assert response.status_code == 400 and response.json()["error"]["param"] == name


# --- reused ids: requests sharing an X-Request-Id all run and are accounted apart ---------------------


@FEW
@given(client_id=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=40),
       num=st.integers(2, 4), stream=st.booleans())
def test_fuzz_reused_request_ids_are_accounted_apart(app, client_id, num, stream):
    async def concurrently() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=str(app.base_url), timeout=120) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body, headers={"X-Request-Id": client_id})
                                          for _ in range(num)))

    body = {"prompt": PROMPT, "max_tokens": 3, "stream": stream}
    responses = asyncio.run(concurrently())
    later = app.post("/v1/completions", json=body, headers={"X-Request-Id": client_id})
    ids = []
    for r in [*responses, later]:
        assert r.status_code == 200 and r.headers.get_list("x-request-id") == [client_id]
        ids.append(json.loads(r.text.splitlines()[0][6:] if stream else r.text)["id"])
    assert len(set(ids)) == num + 1
    for response_id in ids:
        record = app.get(f"/admin/ledger/{response_id}").json()
        assert record["client_request_id"] == client_id and record["status"] == "finished"
        assert record["violations"] == []
