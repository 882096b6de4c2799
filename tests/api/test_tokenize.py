"""vLLM's /tokenize and /detokenize on the standalone app: the same tokenizer and chat template the
generation endpoints use, round trips, and a 400 naming the parameter for bad input."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from pegaserve.api.app import build_app
from pegaserve.api.jobs import LONG_TEXT_CHARS, encode
from pegaserve.tokenizer import Tokenizer
from tests.api.helpers import client_for, scripted_frontend
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


def test_the_openai_client_retrieves_the_model_by_its_name_or_path(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    (listed,) = httpx.get(f"{server.base_url}/v1/models").json()["data"]
    for name in (listed["id"], listed["root"]):  # the root is a local path: it holds '/'
        assert client.models.retrieve(name).model_dump(exclude_none=True) == listed
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no-such-model")
    assert raised.value.body["param"] == "model" and "no-such-model" in raised.value.body["message"]


def test_a_long_text_encodes_to_the_same_ids_as_a_short_one_would(tokenizer):
    """`jobs.encode` takes `encode_batch` (which lets go of the GIL) past LONG_TEXT_CHARS: same ids."""
    text = "🙂 naïve  spaces\n<|im_start|>user hi " * (LONG_TEXT_CHARS // 20)
    assert len(text) >= LONG_TEXT_CHARS
    for add_special_tokens in (True, False):
        assert encode(tokenizer, text, add_special_tokens) == \
            tokenizer.backend.encode(text, add_special_tokens=add_special_tokens).ids


def test_a_huge_prompt_is_tokenized_while_the_event_loop_keeps_serving(tiny_model_dir):
    """A 1 MiB prompt takes about a second to tokenize: it must not stall the app's other streams
    (before: one 4 MiB prompt froze every stream of the ingress for 5.8 s). Ticks of a task that
    sleeps 1 ms count how often the loop ran meanwhile; a blocked loop ticks once or twice."""
    app = build_app(scripted_frontend(tiny_model_dir, {}))
    prompt = "ab" * 500_000

    async def run() -> tuple[dict, int]:
        ticks, done = 0, asyncio.Event()

        async def tick() -> None:
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0.001)
                ticks += 1

        ticker = asyncio.ensure_future(tick())
        async with client_for(app) as client:
            answer = (await client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False})).json()
        done.set()
        await ticker
        return answer, ticks

    answer, ticks = asyncio.run(run())
    assert answer["count"] == len(Tokenizer(tiny_model_dir).backend.encode(prompt, add_special_tokens=False).ids)
    assert ticks >= 20, f"the event loop ran {ticks} times while the prompt was tokenized"
