"""What real clients send, field by field: an explicit null in every optional field is the default,
a lone surrogate in every string field is a 400 naming it, extreme numbers in every numeric field
are a 200 or a 400 with finite JSON; every request gets its own id; engine and transport failures
reach the client as a generic message (the detail goes to the log)."""

from __future__ import annotations

import json
import sys

import httpx
import pytest

from pegaserve.api.app import _event, build_app
from pegaserve.api.body import parse_body
from pegaserve.api.errors import ApiError
from pegaserve.api.frontend import FAILED
from pegaserve.api.protocol import CompletionRequest
from pegaserve.api.services import EngineClient
from pegaserve.config import Limits
from pegaserve.messages import StepOutput
from pegaserve.stop import Error
from tests.api.helpers import PROMPT, raw_json, scripted_frontend
from tests.api.test_fuzz import (
    EXTREME_FLOATS,
    EXTREME_INTS,
    FLOAT_FIELDS,
    INT_FIELDS,
    PATHS,
    STRING_FIELDS,
    base_body,
    check_response,
    optional_fields,
    short,
)
from tests.contract.server import ThreadedServer

LEAKS = ["Traceback", "/work/", ".py", "pid", "actor", "ray::", "SERVE_REPLICA"]


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    with ThreadedServer(build_app(scripted_frontend(tiny_model_dir, {}, limits=Limits(max_tokens=16)))) as server:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            yield client


def post(app: httpx.Client, endpoint: str, body: dict, headers: dict | None = None) -> httpx.Response:
    response = app.post(PATHS[endpoint], content=raw_json(body),
                        headers={"content-type": "application/json", **(headers or {})})
    check_response(response, body)
    return response


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", sorted(PATHS))
def test_null_in_every_field_at_once_is_the_defaults(app, endpoint, stream):
    body = {**base_body(endpoint), **dict.fromkeys(optional_fields(endpoint)), "stream": stream}
    assert post(app, endpoint, body).status_code == 200


NULLS = [(e, name) for e in sorted(PATHS) for name in optional_fields(e)]


@pytest.mark.parametrize("endpoint,name", NULLS, ids=[f"{e}-{n}" for e, n in NULLS])
def test_null_in_each_field_is_its_default(app, endpoint, name):
    response = post(app, endpoint, {**base_body(endpoint), **short(endpoint), name: None})
    assert response.status_code == 200, response.text


def test_a_null_required_field_is_a_400_naming_it(app):
    assert post(app, "completions", {"prompt": None}).json()["error"]["param"] == "prompt"
    assert post(app, "chat", {"messages": None}).json()["error"]["param"] == "messages"


SURROGATE_CASES = [(e, name) for e in sorted(PATHS) for name in sorted(STRING_FIELDS[e])]


@pytest.mark.parametrize("surrogate", ["\ud800", "x\udfffy"])
@pytest.mark.parametrize("endpoint,name", SURROGATE_CASES, ids=[f"{e}-{n}" for e, n in SURROGATE_CASES])
def test_a_lone_surrogate_is_a_400_naming_the_field(app, endpoint, name, surrogate):
    body = {**base_body(endpoint), **short(endpoint), **STRING_FIELDS[endpoint][name](surrogate)}
    response = post(app, endpoint, body)
    assert response.status_code == 400 and response.json()["error"]["param"] == name, response.text


def test_a_surrogate_pair_is_a_character(app):
    body = {"prompt": "\ud83d\ude42", "max_tokens": 2, "echo": True}  # 🙂 as JSON escapes it
    assert post(app, "completions", body).json()["choices"][0]["text"].startswith("🙂")


@pytest.mark.parametrize("raw", [
    b'{"prompt": "hi", "max_tokens": 2, "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # past Python's 4300-digit int limit
], ids=["nested-too-deeply", "a-5000-digit-number"])
@pytest.mark.parametrize("endpoint", sorted(PATHS))
def test_json_python_cannot_read_is_a_400(app, endpoint, raw):
    response = app.post(PATHS[endpoint], content=raw, headers={"content-type": "application/json"})
    check_response(response, raw)
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("malformed JSON")


def test_a_body_nested_to_the_recursion_limit_is_a_200_or_a_400():
    # A `\u` escape sends the parsed body through the surrogate walk, which recurses once per level
    # from a deeper stack than json.loads did: some depth passes the one and not the other.
    for depth in range(1, sys.getrecursionlimit() + 10):
        raw = b'{"prompt": "\\u00e9", "extra": ' + b"[" * depth + b"]" * depth + b"}"
        try:
            parse_body(raw, CompletionRequest, refuse_unknown=False)  # "extra" only carries the nesting
        except ApiError as exc:
            assert exc.status == 400 and exc.param is None, (depth, exc.message)


NUMBERS = [(e, name, value) for e in sorted(PATHS) for name in FLOAT_FIELDS for value in EXTREME_FLOATS] + \
          [(e, name, value) for e in sorted(PATHS) for name in INT_FIELDS[e] for value in EXTREME_INTS]


@pytest.mark.parametrize("endpoint,name,value", NUMBERS, ids=[f"{e}-{n}-{v!r}" for e, n, v in NUMBERS])
def test_extreme_numbers_are_a_200_or_a_400(app, endpoint, name, value):
    logprobs = {"completions": {"logprobs": 2}, "chat": {"logprobs": True, "top_logprobs": 2},
                "responses": {"include": ["message.output_text.logprobs"], "top_logprobs": 2}}[endpoint]
    body = {**base_body(endpoint), **short(endpoint), **logprobs, name: value}
    response = post(app, endpoint, body)
    if response.status_code == 400:
        assert response.json()["error"]["param"] == name, response.text
    else:
        assert response.status_code == 200


@pytest.mark.parametrize("value", EXTREME_FLOATS)
def test_extreme_logit_biases_are_a_200_or_a_400(app, value):
    response = post(app, "completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1, "logit_bias": {"64": value}})
    assert response.status_code == (200 if -100 <= value <= 100 else 400)


def test_every_request_gets_its_own_id_and_keeps_the_clients(app):
    ids = []
    for _ in range(3):  # a client retrying with the same id
        response = post(app, "completions", {"prompt": PROMPT, "max_tokens": 2}, {"X-Request-Id": "retry-1"})
        assert response.headers.get_list("x-request-id") == ["retry-1"]
        ids.append(response.json()["id"])
    assert len(set(ids)) == 3 and all(i.startswith("cmpl-") and len(i) == 37 for i in ids)
    records = [app.get(f"/admin/ledger/{i}").json() for i in ids]
    assert all(r["client_request_id"] == "retry-1" and r["status"] == "finished" for r in records)
    chat = post(app, "chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert chat.json()["id"].startswith("chatcmpl-") and chat.headers["x-request-id"] == chat.json()["id"]


# --- failures: a generic message to the client, the detail to the log --------------------------------

SECRET = "RayActorError: actor pegaserve-decode#3 (pid=4242) at /work/main/deployments/decode.py:77 died"


class Broken(EngineClient):
    """An engine client that fails as a transport may: before any output, or with an error finish."""

    def __init__(self, how: str) -> None:
        self.how = how

    async def generate(self, request):
        if self.how == "raises":
            raise RuntimeError(SECRET)
        for j in range(request.n):
            yield StepOutput(request.choice_id(j), (), Error(SECRET))

    def abort(self, choice_id: str) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("how", ["raises", "error_finish"])
def test_failures_reach_the_client_without_internals(tiny_model_dir, caplog, how, stream):
    frontend = scripted_frontend(tiny_model_dir, {})
    frontend.engine = Broken(how)
    with ThreadedServer(build_app(frontend)) as running:
        response = httpx.post(f"{running.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2,
                                                                         "stream": stream})
        summary = httpx.get(f"{running.base_url}/admin/ledger").json()
    if response.headers["content-type"].startswith("text/event-stream"):  # failed after the headers
        messages = [json.loads(line[6:]).get("error", {}).get("message") for line in response.text.splitlines()
                    if line.startswith("data: {")]
    else:
        assert response.status_code == 500
        messages = [response.json()["error"]["message"]]
    assert FAILED in messages
    assert not any(leak in response.text for leak in LEAKS), response.text
    assert summary["by_status"].get("error") == 1 and summary["invariant_violations"] == 0
    assert SECRET in caplog.text  # the operator still sees it


@pytest.mark.parametrize("body", [
    {"text": "é🙂\n\"", "logprob": -9999.0, "ids": (1, 2)},
    {"text": "x\udfffy"},  # orjson refuses a lone surrogate: the standard encoder escapes it
    {"seed": 2**70},  # past 64 bits: likewise
], ids=["plain", "lone-surrogate", "big-int"])
def test_an_sse_event_is_one_json_line_whatever_its_body(body):
    event = _event(body)
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    expected = {k: list(v) if isinstance(v, tuple) else v for k, v in body.items()}
    assert json.loads(event[len(b"data: "):].decode()) == expected
