"""echo, prompt scoring and vLLM's prompt_logprobs on the standalone frontend with qwen3-tiny's
real weights: the prompt's logprobs are the log-softmax of transformers' Qwen3ForCausalLM logits
on the same weights (the first token has none), in OpenAI's echo shape and in vLLM's."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from tests.api.helpers import sse_chunks

PROMPT = [9707, 11, 1879, 0, 785, 3974, 13876, 38835, 34208, 916]
TOP = 3
# Two fp32 forwards of the same weights that sum in different orders: a logprob of -4.29 differed
# by 1.05e-4 on an AMD EPYC without AVX-512 (the torch path there by 1.08e-4 at another token), so
# the tolerance grows with the logprob's size
CLOSE = {"rel": 5e-5, "abs": 1e-4}


@pytest.fixture(scope="module")
def server(real_server):
    return real_server


@pytest.fixture(scope="module")
def reference(hf) -> torch.Tensor:
    """[len(PROMPT), vocab]: row p is the log-softmax that predicts prompt token p + 1."""
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([PROMPT])).logits[0].double()
    return torch.log_softmax(logits, -1)


def post(server, path="/v1/completions", **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def test_echo_with_logprobs_shows_the_prompt_scored_by_the_reference(server, tiny_model_dir, reference):
    body = post(server, prompt=PROMPT, max_tokens=4, echo=True, logprobs=TOP, temperature=0).json()
    (choice,) = body["choices"]
    prompt_text = server_decode(server, PROMPT)
    assert choice["text"].startswith(prompt_text) and len(choice["text"]) > len(prompt_text)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + 4 == len(logprobs["token_logprobs"])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for p in range(1, len(PROMPT)):
        row = reference[p - 1]
        assert logprobs["token_logprobs"][p] == pytest.approx(row[PROMPT[p]].item(), **CLOSE)
        top, best = logprobs["top_logprobs"][p], torch.topk(row, TOP)
        assert list(top.values())[:TOP] == pytest.approx(best.values.tolist(), **CLOSE)
        if PROMPT[p] in best.indices.tolist():
            assert len(top) == TOP
        else:  # the prompt's own token follows the top-N (OpenAI's legacy completions, vLLM)
            assert len(top) == TOP + 1 and list(top.values())[-1] == pytest.approx(row[PROMPT[p]].item(), **CLOSE)
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"]))
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 4, "total_tokens": len(PROMPT) + 4,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    greedy = post(server, prompt=PROMPT, max_tokens=4, logprobs=TOP, temperature=0).json()["choices"][0]
    assert choice["text"] == prompt_text + greedy["text"]
    assert logprobs["token_logprobs"][len(PROMPT):] == greedy["logprobs"]["token_logprobs"]


def server_decode(server, ids: list[int]) -> str:
    return post(server, "/detokenize", tokens=ids).json()["prompt"]


def test_echo_streams_the_prompt_in_each_choices_first_chunk(server):
    body = {"prompt": [PROMPT, PROMPT[:4]], "n": 2, "max_tokens": 3, "echo": True, "logprobs": 1, "seed": 4,
            "temperature": 1.0}
    plain = post(server, **body).json()
    chunks = sse_chunks(post(server, **body, stream=True).text)
    for choice in plain["choices"]:
        parts = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == choice["index"]]
        prompt = PROMPT if choice["index"] < 2 else PROMPT[:4]
        assert parts[0]["text"].startswith(server_decode(server, prompt))
        assert len(parts[0]["logprobs"]["tokens"]) >= len(prompt)
        assert "".join(p["text"] for p in parts) == choice["text"]
        assert [lp for p in parts for lp in p["logprobs"]["token_logprobs"]] == choice["logprobs"]["token_logprobs"]
        assert [o for p in parts for o in p["logprobs"]["text_offset"]] == choice["logprobs"]["text_offset"]


def test_echo_of_a_string_prompt_is_the_string(server):
    text = "Hello, world! 🙂"
    body = post(server, prompt=text, max_tokens=2, echo=True, temperature=0).json()
    assert body["choices"][0]["text"].startswith(text)


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_0_with_echo_scores_the_prompt_only(server, reference, stream):
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0}
    if stream:
        chunks = sse_chunks(post(server, **body, stream=True, stream_options={"include_usage": True}).text)
        (only,) = [c["choices"][0] for c in chunks if c["choices"]]
        usage = chunks[-1]["usage"]
    else:
        answer = post(server, **body).json()
        only, usage = answer["choices"][0], answer["usage"]
    assert only["text"] == server_decode(server, PROMPT) and only["finish_reason"] == "length"
    assert only["stop_reason"] is None
    assert usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 0, "total_tokens": len(PROMPT),
                     "prompt_tokens_details": {"cached_tokens": 0}}
    logprobs = only["logprobs"]["token_logprobs"]
    assert logprobs[0] is None and len(logprobs) == len(PROMPT)
    assert logprobs[1:] == pytest.approx([reference[p - 1, PROMPT[p]].item() for p in range(1, len(PROMPT))],
                                         **CLOSE)


def test_max_tokens_0_without_echo_is_a_400(server):
    response = post(server, prompt=PROMPT, max_tokens=0)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("k", [0, 2])
def test_prompt_logprobs_in_vllms_shape(server, reference, k):
    body = post(server, prompt=PROMPT, max_tokens=2, prompt_logprobs=k, temperature=0).json()
    scores = body["choices"][0]["prompt_logprobs"]
    assert len(scores) == len(PROMPT) and scores[0] is None
    for p in range(1, len(PROMPT)):
        row, entry = reference[p - 1], scores[p]
        actual = entry[str(PROMPT[p])]
        assert actual["logprob"] == pytest.approx(row[PROMPT[p]].item(), **CLOSE)
        assert actual["rank"] >= 1 and actual["decoded_token"] == server_decode(server, [PROMPT[p]])
        best = torch.topk(row, k).indices.tolist() if k else []
        assert set(entry) == {str(PROMPT[p]), *map(str, best)}
        for rank, token_id in enumerate(best, start=1):
            assert entry[str(token_id)]["rank"] == rank or token_id == PROMPT[p]
    assert body["choices"][0]["logprobs"] is None  # prompt_logprobs alone asks nothing of the completion


def test_chat_prompt_logprobs_are_top_level(server):
    body = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                prompt_logprobs=1).json()
    prompt_tokens = body["usage"]["prompt_tokens"]
    assert len(body["prompt_logprobs"]) == prompt_tokens and body["prompt_logprobs"][0] is None
    assert all(1 <= len(entry) <= 2 for entry in body["prompt_logprobs"][1:])


def test_prompt_logprobs_while_streaming_is_a_400(server):
    response = post(server, prompt=PROMPT, max_tokens=2, prompt_logprobs=1, stream=True)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"


def test_chat_echo_prepends_the_last_message_of_the_reply_role(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    extra = {"echo": True, "add_generation_prompt": False, "continue_final_message": True}
    answer = client.chat.completions.create(model="qwen3-tiny", messages=messages, max_tokens=3, temperature=0,
                                            extra_body=extra)
    plain = client.chat.completions.create(model="qwen3-tiny", messages=messages, max_tokens=3, temperature=0,
                                           extra_body={**extra, "echo": False})
    assert answer.choices[0].message.content == "Hel" + plain.choices[0].message.content
    assert answer.choices[0].message.role == "assistant"
    no_echo = client.chat.completions.create(model="qwen3-tiny", messages=messages[:1], max_tokens=3, temperature=0,
                                             extra_body={"echo": True})  # the last message is the user's
    first = client.chat.completions.create(model="qwen3-tiny", messages=messages[:1], max_tokens=3, temperature=0)
    assert no_echo.choices[0].message.content == first.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_completion_top_logprobs_hold_the_sampled_token_even_at_0(server, stream):
    """OpenAI's legacy completions and vLLM: the top-N and the sampled token (N + 1 entries when it is
    not among them); `logprobs: 0` lists the sampled token alone."""
    for top_n in (0, 2):
        body = {"prompt": PROMPT, "max_tokens": 6, "logprobs": top_n, "seed": 11, "temperature": 1.5}
        if stream:
            parts = [c["choices"][0]["logprobs"] for c in sse_chunks(post(server, **body, stream=True).text)
                     if c["choices"] and c["choices"][0].get("logprobs")]
            logprobs = {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs")}
        else:
            logprobs = post(server, **body).json()["choices"][0]["logprobs"]
        for token, value, top in zip(logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"]):
            assert top[token] == value and top_n <= len(top) <= top_n + 1, (top_n, token, top)
            assert list(top.values())[:top_n] == sorted(top.values(), reverse=True)[:top_n]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_generated_token_carries_its_logprob_when_asked(server, hf, path):
    # the engine computes a decode token's logprob only when the request asks for logprobs: asked
    # for with no alternatives (completions' logprobs=0, chat's logprobs=true), each one is there
    # and is the reference's log-softmax at its position
    chat = path.endswith("chat/completions")
    if chat:
        asked = {"messages": [{"role": "user", "content": "hello"}], "logprobs": True}
    else:
        asked = {"prompt": PROMPT, "logprobs": 0}
    body = post(server, path, max_tokens=6, ignore_eos=True, temperature=0, return_token_ids=True, **asked).json()
    (choice,) = body["choices"]
    if chat:
        logprobs = [entry["logprob"] for entry in choice["logprobs"]["content"]]
    else:
        logprobs = choice["logprobs"]["token_logprobs"]
    prompt = body["prompt_token_ids"] if chat else PROMPT
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([prompt + choice["token_ids"]])).logits[0].double()
    expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(1, torch.tensor(choice["token_ids"])[:, None])
    assert len(logprobs) == 6 and logprobs == pytest.approx(expected[:, 0].tolist(), **CLOSE)


LISTED = [13, 11, 9707, 151645]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_logprob_token_ids_are_exactly_those_tokens_logprobs(server, hf, path):
    # vLLM's logprob_token_ids: each generated token's alternatives are the listed ids' logprobs, in
    # their order, with the chosen token's own (completions: beside them, as its top-N)
    chat = path.endswith("chat/completions")
    asked = {"messages": [{"role": "user", "content": "hello"}], "logprobs": True} if chat else \
        {"prompt": PROMPT, "logprobs": 0}
    body = post(server, path, max_tokens=4, ignore_eos=True, temperature=0, return_token_ids=True,
                logprob_token_ids=LISTED, **asked).json()
    (choice,) = body["choices"]
    prompt = body["prompt_token_ids"] if chat else PROMPT
    with torch.inference_mode():
        logits = hf(input_ids=torch.tensor([prompt + choice["token_ids"]])).logits[0].double()
    expected = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    names = [server_decode(server, [i]) for i in LISTED]
    for position, token_id in enumerate(choice["token_ids"]):
        want = expected[position, LISTED].tolist()
        if chat:
            entry = choice["logprobs"]["content"][position]
            assert [e["token"] for e in entry["top_logprobs"]] == names
            assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx(want, **CLOSE)
        else:
            top = choice["logprobs"]["top_logprobs"][position]
            chosen = server_decode(server, [token_id])
            assert set(top) == set(names) | {chosen}
            assert [top[name] for name in names] == pytest.approx(want, **CLOSE)


@pytest.mark.parametrize(("body", "message"), [
    ({"logprobs": None}, "needs logprobs"),
    ({"logprobs": 2}, "top-N"),
    ({"logprobs": 0, "echo": True}, "echo"),
    ({"logprobs": 0, "logprob_token_ids": [10**7]}, "outside the vocabulary"),
    ({"logprobs": 0, "logprob_token_ids": list(range(129))}, "at most 128"),
    ({"logprobs": 0, "use_beam_search": True, "n": 2}, "use_beam_search"),
])
def test_bad_logprob_token_ids_are_a_400(server, body, message):
    response = post(server, prompt=PROMPT, max_tokens=2, **{"logprob_token_ids": LISTED, **body})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "logprob_token_ids" and message in error["message"]
