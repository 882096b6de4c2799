"""n > 1 on the standalone frontend with qwen3-tiny's real weights: one engine request per prompt,
choice j sampling with seed + j (reproducible, distinct), greedy choices equal, every stop rule per
choice (a stop string ends only its choice), one finishing chunk per choice, usage summed, the
ledger's per-choice records, and OpenAI's numbering over several prompts (p * n + j)."""

from __future__ import annotations

import httpx
import openai
import pytest

from pegaserve.testing.contract import answer_from_body, check_ledger, ledger_keys
from tests.api.helpers import sse_chunks

PROMPT = [9707, 11, 1879, 0, 785, 3974]
OTHER = [16, 220, 17, 11]
TOKENS = 10


@pytest.fixture(scope="module")
def server(real_server):
    return real_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def complete(server, **body) -> dict:
    body = {"max_tokens": TOKENS, "ignore_eos": True, "return_token_ids": True, **body}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream(server, path="/v1/completions", **body) -> list[dict]:
    body = {"max_tokens": TOKENS, "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    response = httpx.post(f"{server.base_url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return sse_chunks(response.text)


def ids_of(body: dict) -> list[list[int]]:
    return [c["token_ids"] for c in sorted(body["choices"], key=lambda c: c["index"])]


def test_choice_j_samples_with_seed_plus_j_reproducibly_and_distinctly(server):
    grouped = complete(server, prompt=PROMPT, n=3, seed=7, temperature=1.0)
    again = complete(server, prompt=PROMPT, n=3, seed=7, temperature=1.0)
    assert ids_of(grouped) == ids_of(again)
    alone = [ids_of(complete(server, prompt=PROMPT, seed=7 + j, temperature=1.0))[0] for j in range(3)]
    assert ids_of(grouped) == alone
    assert len({tuple(ids) for ids in alone}) == 3
    assert [c["index"] for c in grouped["choices"]] == [0, 1, 2]


def test_greedy_choices_are_equal(server):
    one = ids_of(complete(server, prompt=PROMPT, temperature=0))[0]
    assert ids_of(complete(server, prompt=PROMPT, n=4, temperature=0)) == [one] * 4


def test_usage_sums_the_choices_and_counts_the_prompt_once(server):
    body = complete(server, prompt=PROMPT, n=3, seed=1, max_tokens=5, min_tokens=2, ignore_eos=False)
    counts = [len(ids) for ids in ids_of(body)]
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": sum(counts),
                             "total_tokens": len(PROMPT) + sum(counts),
                             "prompt_tokens_details": {"cached_tokens": 0}}  # a prompt of less than a block


def _distinct_stop(texts: list[str]) -> str:
    """A two-character piece of the first text that no other text holds."""
    first = texts[0]
    for start in range(len(first) - 1):
        piece = first[start:start + 2]
        if piece.strip() and all(piece not in t for t in texts[1:]) and piece not in first[:start + 1]:
            return piece
    raise AssertionError(f"no distinct stop string in {texts!r}")


def test_a_stop_string_ends_only_its_choice(server):
    free = complete(server, prompt=PROMPT, n=3, seed=11, temperature=1.0)
    texts = [c["text"] for c in free["choices"]]
    stop = _distinct_stop(texts)
    stopped = complete(server, prompt=PROMPT, n=3, seed=11, temperature=1.0, stop=[stop])
    first, *others = stopped["choices"]
    assert first["finish_reason"] == "stop" and first["stop_reason"] == stop
    assert first["text"] == texts[0][: texts[0].index(stop)] and len(first["token_ids"]) < TOKENS
    assert [(c["text"], c["token_ids"], c["finish_reason"]) for c in others] == \
           [(c["text"], c["token_ids"], "length") for c in free["choices"][1:]]
    assert stopped["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in stopped["choices"])
    records = httpx.get(f"{server.base_url}/admin/ledger/{stopped['id']}").json()["choices"]
    assert [r["stop_cause"]["kind"] for r in records] == ["string", "length", "length"]
    stats = httpx.get(f"{server.base_url}/admin/stats").json()["colocated"][0]
    assert stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]  # aborted, freed


def test_streaming_has_one_finishing_chunk_per_choice_and_equals_the_body(server):
    body = {"prompt": [PROMPT, OTHER], "n": 2, "seed": 3, "temperature": 1.0, "logprobs": 1}
    plain = complete(server, **body)
    chunks = stream(server, **body)
    finishing = [c["choices"][0]["index"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(finishing) == [0, 1, 2, 3]
    for choice in plain["choices"]:
        parts = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        assert "".join(p["text"] for p in parts) == choice["text"]
        assert [i for p in parts for i in p["token_ids"]] == choice["token_ids"]
        assert [lp for p in parts for lp in p["logprobs"]["token_logprobs"]] == choice["logprobs"]["token_logprobs"]
    assert chunks[-1]["usage"] == plain["usage"] and chunks[-1]["choices"] == []
    assert plain["usage"]["prompt_tokens"] == len(PROMPT) + len(OTHER)


def test_several_prompts_number_their_choices_p_times_n_plus_j(server):
    body = complete(server, prompt=[PROMPT, OTHER], n=2, temperature=0)
    one = ids_of(complete(server, prompt=PROMPT, temperature=0))[0]
    other = ids_of(complete(server, prompt=OTHER, temperature=0))[0]
    assert ids_of(body) == [one, one, other, other]
    assert [c["prompt_token_ids"] for c in body["choices"]] == [PROMPT, PROMPT, OTHER, OTHER]


def test_the_ledger_keeps_one_record_per_choice(server):
    body = complete(server, prompt=[PROMPT, OTHER], n=2, seed=5, temperature=1.0)
    view = httpx.get(f"{server.base_url}/admin/ledger/{body['id']}").json()
    keys = [r["request_id"] for r in view["choices"]]
    rid = body["id"]
    assert keys == [f"{rid}-0/0", f"{rid}-0/1", f"{rid}-1/0", f"{rid}-1/1"]  # unique per request and prompt
    assert [r["prompt_tokens"] for r in view["choices"]] == [len(PROMPT), 0, len(OTHER), 0]  # shared prefills
    assert view["completion_tokens"] == body["usage"]["completion_tokens"] and view["status"] == "finished"
    answer = answer_from_body(body, chat=False)
    records = [httpx.get(f"{server.base_url}/admin/ledger/{key}").json() for key in ledger_keys(answer)]
    assert records == view["choices"]
    assert check_ledger(answer, records) == []


def test_chat_choices_with_the_openai_client(client, server):
    messages = [{"role": "user", "content": "hello"}]
    response = client.chat.completions.create(model="qwen3-tiny", messages=messages, n=3, seed=2, max_tokens=6,
                                              extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert len({c.message.content for c in response.choices}) > 1 and response.id.startswith("chatcmpl-")
    assert all(c.message.role == "assistant" and c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 18
    chunks = list(client.chat.completions.create(model="qwen3-tiny", messages=messages, n=3, seed=2, max_tokens=6,
                                                 stream=True, extra_body={"ignore_eos": True}))
    texts = {i: "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
             for i in range(3)}
    assert texts == {c.index: c.message.content for c in response.choices}
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1, 2]  # each choice opens with its role


def test_best_of_equal_to_n_returns_every_choice(server):
    body = complete(server, prompt=PROMPT, n=2, best_of=2, temperature=0)
    assert len(body["choices"]) == 2
