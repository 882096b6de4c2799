"""vLLM's /tokenize and /detokenize on the standalone app: the same tokenizer and chat template the
generation endpoints use, round trips, and a 400 naming the parameter for bad input."""

from __future__ import annotations

import json

import httpx
import pytest

from pegaserve.api.app import build_app
from pegaserve.tokenizer import Tokenizer
from tests.api.helpers import scripted_frontend
from tests.contract.server import ThreadedServer

TEXTS = ["Hello, world!", "🙂 multi-byte ✓ naïve", " leading and  double  spaces\n", "<|im_start|>user\nhi<|im_end|>",
         ""]
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with ThreadedServer(build_app(scripted_frontend(tiny_model_dir, {}))) as running:
        yield running


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return Tokenizer(tiny_model_dir)


def post(server, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=60)


@pytest.mark.parametrize("text", TEXTS)
def test_tokenize_then_detokenize_is_the_text(server, tokenizer, text):
    answer = post(server, "/tokenize", prompt=text, return_token_strs=True).json()
    assert answer["tokens"] == tokenizer.backend.encode(text, add_special_tokens=True).ids
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == 4096
    assert answer["token_strs"] == tokenizer.hf.convert_ids_to_tokens(answer["tokens"])
    assert post(server, "/detokenize", tokens=answer["tokens"]).json() == {"prompt": text}


def test_token_strs_only_when_asked(server):
    assert "token_strs" not in post(server, "/tokenize", prompt="hi").json()


def test_messages_tokenize_as_the_chat_endpoint_renders_them(server, tokenizer):
    answer = post(server, "/tokenize", messages=MESSAGES).json()
    rendered = tokenizer.hf.apply_chat_template([{"role": "system", "content": "be brief"},
                                                 {"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True)
    assert answer["tokens"] == tokenizer.encode(rendered)
    chat = post(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=1, return_token_ids=True).json()
    assert chat["prompt_token_ids"] == answer["tokens"] and chat["usage"]["prompt_tokens"] == answer["count"]
    without = post(server, "/tokenize", messages=MESSAGES, add_generation_prompt=False).json()
    assert answer["tokens"][: without["count"]] == without["tokens"] and without["count"] < answer["count"]


def test_completion_prompts_count_as_tokenize_says(server):
    answer = post(server, "/tokenize", prompt="Hello, world!").json()
    body = post(server, "/v1/completions", prompt="Hello, world!", max_tokens=1, return_token_ids=True).json()
    assert body["choices"][0]["prompt_token_ids"] == answer["tokens"]


BAD = [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, "model"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, "messages"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/detokenize", {"tokens": [151936]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "5"}, "tokens"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-9"}, "model"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p}-{param}-{i}" for i, (p, _, param) in enumerate(BAD)])
def test_bad_input_is_a_4xx_naming_the_param(server, path, body, param):
    response = httpx.post(f"{server.base_url}{path}", content=json.dumps(body),
                          headers={"content-type": "application/json"})
    assert response.status_code == (404 if param == "model" else 400), response.text
    assert response.json()["error"]["param"] == param


def test_models_keeps_its_fields(server):
    (model,) = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    assert set(model) == {"id", "object", "created", "owned_by", "root", "max_model_len"}
