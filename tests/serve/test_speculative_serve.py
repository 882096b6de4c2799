"""Speculative decoding through the HTTP API, P/D and colocated: with a scripted model whose output
continues its prompt's loop (so drafts are accepted in long runs), every answer — text, token ids,
logprobs, finish, stop_reason, usage — equals the same request without speculation, streaming and
not, with stop ids, EOS, stop strings and max_tokens landing inside accepted runs (docs/contract.md
rules 1, 9, 10, 19)."""

from __future__ import annotations

import httpx
import pytest
from ray import serve

from pegaserve.api.jobs import render_chat
from pegaserve.api.protocol import ChatMessage
from pegaserve.testing.contract import answer_from_body, answer_from_sse
from pegaserve.tokenizer import Tokenizer
from tests.serve.helpers import deploy, start_ray

pytestmark = pytest.mark.ray
LOOP = (21, 22, 23, 24)  # "6789"
PROMPT = (151644, *LOOP * 3)
SCRIPT = {PROMPT: (*LOOP * 3, 151645, *LOOP * 2)}  # twelve loop tokens, EOS, more loop
CHAT = [{"role": "user", "content": "hi"}]
ANSWER = " the quick brown fox jumps over the lazy dog, and over the lazy dog again"
SPEC = {"method": "ngram", "num_draft_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
CASES = [
    {"max_tokens": 20},  # ends at the scripted EOS, inside an accepted run
    {"max_tokens": 20, "ignore_eos": True},  # runs through the EOS to the length limit
    {"max_tokens": 7, "ignore_eos": True},  # length inside a run
    {"max_tokens": 20, "stop_token_ids": [23]},  # a stop id at the third token
    {"max_tokens": 20, "stop_token_ids": [24], "min_tokens": 5},  # masked early, then a stop inside a run
    {"max_tokens": 20, "stop": ["96"]},  # a stop string across two tokens of a run
    {"max_tokens": 20, "stop": ["9678", "78"], "include_stop_str_in_output": True},  # earliest end wins
    {"max_tokens": 20, "logprobs": 2, "return_token_ids": True},
]


def chat_script(tiny_model_dir) -> dict:
    """CHAT's prompt, rendered as the chat endpoint does, followed by ANSWER's tokens."""
    tokenizer = Tokenizer(tiny_model_dir)
    prompt = render_chat(tokenizer, [ChatMessage(**m) for m in CHAT], True, False, None)
    encode = tokenizer.backend.encode
    return {tuple(encode(prompt, add_special_tokens=False).ids): tuple(encode(ANSWER, add_special_tokens=False).ids)}


@pytest.fixture(scope="module")
def urls(tiny_model_dir):
    start_ray()
    doubles = {"script": {**SCRIPT, **chat_script(tiny_model_dir)}}
    apps = {
        "nospec": deploy("nospec", {"transport": "gloo"}, doubles=doubles),
        "spec": deploy("spec", {"transport": "gloo", "speculative": SPEC}, doubles=doubles),
        "cospec": deploy("cospec", {"mode": "colocated", "speculative": SPEC}, doubles=doubles),
    }
    yield apps
    for name in apps:
        serve.delete(name)


def answer(url: str, params: dict, stream: bool):
    body = {"prompt": list(PROMPT), "temperature": 0, "return_token_ids": True, "logprobs": 0, **params}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            return answer_from_sse([line for line in response.iter_lines() if line], chat=False)
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return answer_from_body(response.json(), chat=False)


def comparable(a):
    (choice,) = a.choices
    return (choice.text, choice.token_ids, choice.finish_reason, choice.stop_reason, a.usage,
            [round(lp, 3) for lp in choice.logprobs or ()])


@pytest.mark.parametrize("params", CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_answers_with_speculation_equal_answers_without(urls, params, stream):
    reference = comparable(answer(urls["nospec"], params, stream))
    assert comparable(answer(urls["spec"], params, stream)) == reference
    assert comparable(answer(urls["cospec"], params, stream)) == reference


def test_drafts_were_proposed_and_accepted(urls):
    for app in ("spec", "cospec"):
        stats = httpx.get(f"{urls[app]}/admin/stats").json()
        engines = [s for s in stats.values() if s["role"] in ("decode", "both")]
        assert engines and sum(s["num_accepted_tokens"] for s in engines) > 0, stats
        assert all(s["mean_tokens_per_step"] is None or s["mean_tokens_per_step"] > 1 for s in engines)
    plain = httpx.get(f"{urls['nospec']}/admin/stats").json()
    assert all(s["num_draft_tokens"] == 0 for s in plain.values())


@pytest.mark.parametrize("app", ["nospec", "spec"])
def test_a_prediction_through_pd_changes_no_token_and_reports_its_drafts(urls, app):
    """OpenAI's predicted output on P/D (decode drafts from it, with or without `speculative`): the
    same tokens, and usage says how many of the prediction's drafts were kept or turned away."""
    body = {"messages": CHAT, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    plain = httpx.post(f"{urls['nospec']}/v1/chat/completions", json=body, timeout=60).json()
    assert plain["choices"][0]["message"]["content"] == ANSWER[:len(plain["choices"][0]["message"]["content"])]
    for prediction, kept in ((ANSWER, 8), (" the quick brown cat sleeps", 0)):
        answer = httpx.post(f"{urls[app]}/v1/chat/completions", timeout=60,
                            json={**body, "prediction": {"type": "content", "content": prediction}}).json()
        assert answer["choices"] == plain["choices"]
        details = answer["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] >= kept and details["rejected_prediction_tokens"] >= 0
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] <= 11, details
    assert "completion_tokens_details" not in plain["usage"]
