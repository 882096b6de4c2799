"""docs/contract.md end to end on the standalone frontend: every case streaming and not, via the
openai client; validation; the trigger emitted once with its finish (rule 18), also inside the
multi-token steps of speculative decoding; the ledger."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pegaserve.api.app import build_app
from pegaserve.config import EngineConfig, SpeculativeConfig
from pegaserve.tokenizer import Tokenizer
from tests.api.helpers import scripted_frontend
from tests.contract import cases
from tests.contract.cases import CASES, EOS, ONE_COMMA_TWO
from tests.contract.checks import check_case
from tests.contract.server import ThreadedServer


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    frontend = scripted_frontend(tiny_model_dir, cases.script(Tokenizer(tiny_model_dir)))
    with ThreadedServer(build_app(frontend)) as running:
        running.frontend = frontend
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[c.name for c in CASES])
def test_contract_case(client, server, index):
    check_case(client, server.base_url, index)


def test_every_contract_rule_has_a_case():
    covered = {rule for case in CASES for rule in case.rules}
    # 1 (no token after the trigger), 11 (abort on a string stop) and 18 (the trigger with its
    # finish) have dedicated tests below and in test_choice_stream.py.
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


def test_client_request_id_is_a_correlation_label(client, server):
    response = client.completions.with_raw_response.create(
        model="qwen3-tiny", prompt=list(CASES[0].prompt(0)), max_tokens=4, temperature=0,
        extra_headers={"X-Request-Id": "my-request-42"},
    )
    answer = response.parse()
    assert answer.id.startswith("cmpl-") and answer.id != "my-request-42"
    assert response.headers.get_list("x-request-id") == ["my-request-42"]  # echoed once
    record = httpx.get(f"{server.base_url}/admin/ledger/{answer.id}").json()
    assert record["status"] == "finished" and record["stop_cause"]["kind"] == "eos"
    assert record["client_request_id"] == "my-request-42"


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
    ({"n": 0}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"max_tokens": -1, "echo": True}, "max_tokens"),
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


# --- rule 18: the trigger is emitted once, with its finish, in the finishing chunk -------------------

SPECULATIVE = EngineConfig(speculative=SpeculativeConfig(num_draft_tokens=4, prompt_lookup_min=1,
                                                          prompt_lookup_max=2))


# The prompt holds "\n 1, 2\n": after the first generated " ", n-gram speculation finds "\n " in it
# and proposes "1, 2", so the stop id 17 arrives inside a multi-token accepted run.
TRIGGER_PROMPT = [151644, 40000, 198, *ONE_COMMA_TWO, 198]


@pytest.fixture(scope="module", params=["one_token_steps", "speculative_steps"])
def trigger_server(tiny_model_dir, request):
    script = {tuple(TRIGGER_PROMPT): ONE_COMMA_TWO, (151644, 40001, 198): (64, 293, EOS)}
    config = SPECULATIVE if request.param == "speculative_steps" else EngineConfig()
    with ThreadedServer(build_app(scripted_frontend(tiny_model_dir, script, config))) as running:
        running.speculative = request.param == "speculative_steps"
        yield running


@pytest.mark.parametrize("include", [False, True])
def test_the_trigger_is_emitted_once_with_its_finish(trigger_server, include):
    body = {"prompt": TRIGGER_PROMPT, "max_tokens": 8, "temperature": 0, "stop_token_ids": [17], "logprobs": 0,
            "return_token_ids": True, "include_stop_str_in_output": include}
    plain = httpx.post(f"{trigger_server.base_url}/v1/completions", json=body).json()
    with httpx.stream("POST", f"{trigger_server.base_url}/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    ids = [i for c in chunks for i in c["choices"][0]["token_ids"]]
    assert ids == list(ONE_COMMA_TWO) == plain["choices"][0]["token_ids"]
    last = chunks[-1]["choices"][0]
    assert last["token_ids"][-1] == 17 and last["finish_reason"] == "stop" and last["stop_reason"] == 17
    assert len(last["logprobs"]["token_logprobs"]) == len(last["token_ids"])
    assert all(lp < 0 for lp in last["logprobs"]["token_logprobs"])
    assert all(c["choices"][0]["finish_reason"] is None and 17 not in c["choices"][0]["token_ids"]
               for c in chunks[:-1])
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == plain["choices"][0]["text"] == (" 1, 2" if include else " 1, ")
    assert plain["usage"]["completion_tokens"] == 5
    if trigger_server.speculative:  # the trigger came inside an accepted run of drafts
        assert len(last["token_ids"]) > 1
        stats = httpx.get(f"{trigger_server.base_url}/admin/stats").json()["colocated"][0]
        assert stats["num_accepted_tokens"] >= 3


@pytest.mark.parametrize("stream", [False, True])
def test_an_eos_trigger_is_counted_once_and_not_shown(trigger_server, stream):
    body = {"prompt": [151644, 40001, 198], "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "stream": stream}
    response = httpx.post(f"{trigger_server.base_url}/v1/completions", json=body)
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")] \
        if stream else [response.json()]
    ids = [i for c in chunks for i in c["choices"][0]["token_ids"]]
    assert ids == [64, 293, EOS] and chunks[-1]["choices"][0]["token_ids"][-1] == EOS
    assert "".join(c["choices"][0]["text"] for c in chunks) == "a b"
