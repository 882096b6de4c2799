"""docs/CONTRACT.md end to end on the colocated server: every case streaming and not, via the openai
client; validation; the split-message case; the ledger."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pegaserve.api.app import build_app
from pegaserve.api.clients import EngineClient
from pegaserve.api.local import build_local_server
from pegaserve.engine.request import StepOutput
from pegaserve.stop import Eos, Length, Token
from pegaserve.tokenizer import Tokenizer
from tests.contract import cases
from tests.contract.cases import CASES, EOS, ONE_COMMA_TWO
from tests.contract.checks import check_case
from tests.contract.server import ThreadedServer


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    tokenizer = Tokenizer(tiny_model_dir)
    local = build_local_server(script=cases.script(tokenizer))
    with ThreadedServer(build_app(local)) as running:
        running.local = local
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_contract_case(client, server, index):
    check_case(client, server.base_url, index)


def test_every_contract_rule_has_a_case():
    covered = {rule for case in CASES for rule in case.rules}
    # 1 (no token after the trigger), 11 (abort on a string stop) and 18 (split messages) have
    # dedicated tests below and in test_choice_stream.py.
    assert covered | {1, 11, 18} >= set(range(2, 23)) - {20, 22}


def test_raw_sse_ends_with_done(server):
    body = {"prompt": list(CASES[0].prompt(0)), "max_tokens": 8, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in lines)


def test_string_stop_aborts_the_engine_request(client, server):
    index = next(i for i, c in enumerate(CASES) if c.name == "stop_string_spans_tokens")
    check_case(client, server.base_url, index)
    stats = httpx.get(f"{server.base_url}/admin/stats").json()["colocated"][0]
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_client_request_id_is_the_key(client, server):
    response = client.completions.with_raw_response.create(
        model="qwen3-tiny", prompt=list(CASES[0].prompt(0)), max_tokens=4, temperature=0,
        extra_headers={"X-Request-Id": "my-request-42"},
    )
    assert response.parse().id == "my-request-42" and response.headers["x-request-id"] == "my-request-42"
    record = httpx.get(f"{server.base_url}/admin/ledger/my-request-42").json()
    assert record["status"] == "finished" and record["stop_cause"]["kind"] == "eos"


def test_models_and_health(server):
    models = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert models[0]["id"] == "qwen3-tiny" and models[0]["max_model_len"] == 4096
    assert models[0]["root"].endswith("qwen3-tiny")
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}


def test_batch_of_prompts(client):
    prompts = [list(CASES[0].prompt(0)), list(CASES[2].prompt(2))]
    response = client.completions.create(model="qwen3-tiny", prompt=prompts, max_tokens=16, temperature=0,
                                         extra_body={"stop_token_ids": [17]})
    texts = sorted((c.index, c.text) for c in response.choices)
    assert texts == [(0, "a b"), (1, " 1, ")]
    assert response.usage.completion_tokens == 3 + 5


# --- validation: 400 with an OpenAI error body naming the parameter ---------------------------------

PROMPT = [151644, 40000, 198]
BAD_COMPLETIONS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"prompt": list(range(1, 4097)), "max_tokens": 1}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [999999]}, "prompt"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"stop": [""]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop_token_ids": [151936]}, "stop_token_ids"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"max_tokens": "4"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"stop": 5}, "stop"),
    ({"prompt": 5}, "prompt"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"n": 2}, "n"),
    ({"echo": True}, "echo"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"min_tokens": 1, "stop_token_ids": list(range(151936))}, "min_tokens"),
]


@pytest.mark.parametrize("patch,param", BAD_COMPLETIONS, ids=[p for _, p in BAD_COMPLETIONS])
def test_bad_completion_is_400_naming_the_param(server, patch, param):
    body = {"model": "qwen3-tiny", "prompt": PROMPT, "max_tokens": 8, **patch}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


BAD_CHATS = [
    ({"messages": []}, "messages"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"messages": "hi"}, "messages"),
]


@pytest.mark.parametrize("patch,param", BAD_CHATS, ids=[p for _, p in BAD_CHATS])
def test_bad_chat_is_400_naming_the_param(server, patch, param):
    body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **patch}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert info.value.body["param"] == "model"


def test_malformed_json_is_400(server):
    response = httpx.post(f"{server.base_url}/v1/completions", content=b"{not json",
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "error" in response.json()
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # and the server keeps serving


# --- rule 18: a trigger whose finish arrives in a later engine message ------------------------------


class SplitFinishes(EngineClient):
    """Delays every token-level decision to a message of its own, as a P/D hop may."""

    def __init__(self, inner: EngineClient) -> None:
        self.inner = inner

    async def generate(self, request):
        async for output in self.inner.generate(request):
            if isinstance(output.finish, Eos | Token | Length):
                yield StepOutput(output.request_id, output.tokens, None, finish_pending=True)
                yield StepOutput(output.request_id, (), output.finish)
            else:
                yield output


@pytest.fixture(scope="module")
def split_server(tiny_model_dir):
    local = build_local_server(script={tuple(PROMPT): ONE_COMMA_TWO, (151644, 40001, 198): (64, 293, EOS)})
    local.engine = SplitFinishes(local.engine)
    with ThreadedServer(build_app(local)) as running:
        yield running


@pytest.mark.parametrize("include", [False, True])
def test_split_finish_emits_the_trigger_once_as_the_finishing_chunk(split_server, include):
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": [17], "logprobs": 0,
            "return_token_ids": True, "include_stop_str_in_output": include}
    plain = httpx.post(f"{split_server.base_url}/v1/completions", json=body).json()
    with httpx.stream("POST", f"{split_server.base_url}/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    ids = [i for c in chunks for i in c["choices"][0]["token_ids"]]
    assert ids == list(ONE_COMMA_TWO) == plain["choices"][0]["token_ids"]
    last = chunks[-1]["choices"][0]
    assert last["token_ids"] == [17] and last["finish_reason"] == "stop" and last["stop_reason"] == 17
    assert last["logprobs"]["token_logprobs"][0] < 0
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == plain["choices"][0]["text"] == (" 1, 2" if include else " 1, ")
    assert plain["usage"]["completion_tokens"] == 5
