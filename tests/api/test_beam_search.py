"""Beam search (`use_beam_search`, `length_penalty`; pegaserve/api/beam.py): the search itself over
a made-up model whose alternatives the test chooses (ranking, EOS, stop ids, stop strings, the
length penalty), then through the API on qwen3-tiny's real weights against a beam search of
transformers' logits, streamed and not, completions and chat, with its ledger; what beam search
cannot honour is a 400."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pegaserve.api.beam import BeamPlan, beam_search, num_alternatives
from pegaserve.api.choice import ChoiceStream, StopStrings
from pegaserve.messages import SampledToken
from pegaserve.stop import Eos, Length, StopPolicy, String, Token
from pegaserve.testing.contract import answer_from_body, check_ledger, ledger_keys
from pegaserve.tokenizer import Tokenizer
from tests.api.helpers import reference_beams, sse_chunks

PROMPT = (9707, 11, 1879, 0, 785, 3974, 13876, 38835, 34208, 916)
EOS = 151645
A, B, C, D, X, Y = 64, 65, 66, 67, 87, 88  # "a" "b" "c" "d" "x" "y"


def made_up_model(tree: dict[tuple[int, ...], list[tuple[int, float]]]):
    """A step function: after output `o`, the alternatives `tree[o]` (best first), then filler far below."""
    asked = []

    async def step(contexts):
        asked.append(len(contexts))
        out = []
        for context in contexts:
            chosen = tree.get(tuple(context[len(PROMPT):]), [])
            filler = [(200 + k, -30.0 - k) for k in range(16)]
            out.append(SampledToken(chosen[0][0] if chosen else 200, None, tuple(chosen + filler)))
        return out

    return step, asked


def search(step, width, max_tokens=3, length_penalty=1.0, stops=None, num_top=None, **policy):
    policy = StopPolicy(max_tokens=max_tokens, eos_token_ids=frozenset({EOS}), **policy)
    return asyncio.run(beam_search(step, PROMPT, policy, BeamPlan(width, length_penalty), num_top, stops))


def test_the_best_beam_can_start_with_a_token_greedy_would_not_pick():
    step, asked = made_up_model({
        (): [(A, -0.5), (B, -0.9)],
        (A,): [(X, -2.0), (Y, -2.1)],
        (B,): [(Y, -0.1), (X, -3.0)],
    })
    beams = search(step, width=2, max_tokens=2)
    assert [b.token_ids for b in beams] == [(B, Y), (A, X)]
    assert [b.cum_logprob for b in beams] == pytest.approx([-1.0, -2.5])
    assert all(isinstance(b.finish, Length) for b in beams)
    assert asked == [1, 2]  # the prompt alone, then one context per live beam


def test_eos_ends_a_beam_and_the_length_penalty_weighs_it_against_longer_ones():
    tree = {
        (): [(A, -1.1), (EOS, -1.5)],
        (A,): [(B, -0.3), (C, -0.4)],
        (A, B): [(C, -0.3), (D, -0.5)],
        (A, C): [(D, -0.3), (C, -0.6)],
    }
    # the EOS beam scores -1.5 / 10 (its EOS not counted), the best long one -1.7 / 13: better by
    # length, worse by logprob alone
    by_length = search(made_up_model(tree)[0], width=1, length_penalty=1.0)
    assert by_length[0].token_ids == (A, B, C) and by_length[0].finish == Length()
    raw = search(made_up_model(tree)[0], width=1, length_penalty=0.0)
    assert raw[0].token_ids == (EOS,) and raw[0].finish == Eos(EOS)  # the trigger stays in its tokens (rule 7)
    assert search(made_up_model(tree)[0], width=1, ignore_eos=True, length_penalty=0.0)[0].token_ids == (A, B, C)


def test_a_stop_token_id_ends_a_beam_with_its_token():
    step, _ = made_up_model({(): [(A, -0.1), (B, -0.2)], (A,): [(C, -0.1), (D, -0.2)], (B,): [(C, -5.0)]})
    beams = search(step, width=2, max_tokens=3, stop_token_ids=frozenset({C}), length_penalty=0.0)
    assert beams[0].token_ids == (A, C) and beams[0].finish == Token(C)


def test_a_stop_string_ends_a_beam_where_its_text_completes(tiny_model_dir):
    tokenizer = Tokenizer(tiny_model_dir)

    def new_stream():
        return ChoiceStream(tokenizer.detokenizer(True), StopStrings(("bc",)))

    step, _ = made_up_model({(): [(A, -0.1)], (A,): [(B, -0.1)], (A, B): [(C, -0.1), (D, -0.2)],
                             (A, B, D): [(D, -0.1)]})
    beams = search(step, width=2, max_tokens=4, stops=new_stream, length_penalty=0.0)
    assert beams[0].token_ids == (A, B, C) and beams[0].finish == String("bc")
    assert beams[1].token_ids[:3] == (A, B, D) and beams[1].finish == Length()


def test_logprobs_show_the_clients_alternatives_and_steps_ask_for_enough():
    step, _ = made_up_model({(): [(A, -0.1), (B, -0.2), (C, -0.3)]})
    (beam,) = search(step, width=1, max_tokens=1, num_top=2)
    assert beam.tokens[0].logprob == -0.1 and beam.tokens[0].top_logprobs == ((A, -0.1), (B, -0.2))
    assert num_alternatives(BeamPlan(3), None) == 6 and num_alternatives(BeamPlan(3), 9) == 9


# --- through the API, on the real weights ------------------------------------------------------

@pytest.fixture(scope="module")
def server(real_server):
    return real_server


def post(server, path="/v1/completions", **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120)


def test_completions_beams_are_transformers_beam_search(server, hf):
    body = post(server, prompt=list(PROMPT), max_tokens=6, n=3, use_beam_search=True, ignore_eos=True,
                logprobs=2, return_token_ids=True).json()
    expected = reference_beams(hf, PROMPT, 3, 6)
    assert [c["token_ids"] for c in body["choices"]] == [list(tokens) for tokens, _ in expected]
    for choice, (_, logprobs) in zip(body["choices"], expected):
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, rel=5e-5, abs=1e-4)
        for token, top in zip(choice["logprobs"]["tokens"], choice["logprobs"]["top_logprobs"]):
            assert token in top and len(top) in (2, 3)  # the best two, and the beam's own token (OpenAI's)
        assert choice["finish_reason"] == "length" and choice["index"] == body["choices"].index(choice)
    usage = body["usage"]
    assert usage.pop("prompt_tokens_details")["cached_tokens"] % 16 == 0  # whole blocks, as the first step found
    assert usage == {"prompt_tokens": len(PROMPT), "completion_tokens": 18, "total_tokens": len(PROMPT) + 18}
    longer = [*PROMPT, 13, *PROMPT, 13, *PROMPT, 13, *PROMPT]  # 43 tokens: two whole blocks, then some
    for _ in range(2):  # the second time, the prefix cache holds the two
        again = post(server, prompt=longer, max_tokens=2, n=2, use_beam_search=True, ignore_eos=True).json()
    assert again["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_beams_equal_the_unstreamed_ones(server, path):
    chat = path.endswith("chat/completions")
    asked = {"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": list(PROMPT)}
    body = dict(asked, max_tokens=5, n=2, use_beam_search=True, ignore_eos=True, return_token_ids=True,
                stop=["\u505a"])
    whole = post(server, path, **body).json()
    chunks = sse_chunks(post(server, path, stream=True, stream_options={"include_usage": True}, **body).text)
    for choice in whole["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == choice["index"]]
        text = "".join((m["delta"].get("content") or "") if chat else m["text"] for m in mine)
        assert text == (choice["message"]["content"] if chat else choice["text"])
        assert [i for m in mine for i in m.get("token_ids") or []] == choice["token_ids"]
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == [choice["finish_reason"]]
    assert chunks[-1]["usage"] == whole["usage"]


def test_a_stop_string_cuts_a_beams_text_and_keeps_its_trigger(server):
    plain = post(server, prompt=list(PROMPT), max_tokens=6, n=2, use_beam_search=True, ignore_eos=True,
                 return_token_ids=True).json()
    best = plain["choices"][0]
    stop = best["text"][len(best["text"]) // 2:][:2]
    body = post(server, prompt=list(PROMPT), max_tokens=6, n=2, use_beam_search=True, ignore_eos=True,
                return_token_ids=True, stop=[stop]).json()
    for choice in body["choices"]:
        if choice["finish_reason"] == "stop":
            assert choice["stop_reason"] == stop and stop not in choice["text"]
    assert any(c["finish_reason"] == "stop" for c in body["choices"])


def test_every_step_and_every_beam_has_its_ledger_record(server):
    before = httpx.get(f"{server.base_url}/admin/ledger").json()
    body = post(server, prompt=list(PROMPT), max_tokens=4, n=2, use_beam_search=True, ignore_eos=True,
                return_token_ids=True).json()
    after = httpx.get(f"{server.base_url}/admin/ledger").json()
    # the summary counts the client's two choices; the steps' 1 + 2 + 2 + 2 requests apart
    assert after["by_status"]["finished"] - before["by_status"].get("finished", 0) == 2
    assert after["internal_requests"] - before["internal_requests"] == 7
    answer = answer_from_body(body, chat=False)
    records = [httpx.get(f"{server.base_url}/admin/ledger/{key}").json() for key in ledger_keys(answer)]
    assert check_ledger(answer, records) == []
    first_step = httpx.get(f"{server.base_url}/admin/ledger/{body['id']}-beam1.0").json()
    assert first_step["status"] == "finished" and first_step["completion_tokens"] == 1 and first_step["internal"]
    assert first_step["prompt_tokens"] == len(PROMPT)
    last_step = httpx.get(f"{server.base_url}/admin/ledger/{body['id']}-beam4.1").json()
    assert last_step["prompt_tokens"] == len(PROMPT) + 3
    assert httpx.get(f"{server.base_url}/admin/ledger").json()["by_status"]["in_flight"] == 0


@pytest.mark.parametrize("extra, param", [
    ({"temperature": 0.7}, "temperature"),
    ({"top_p": 0.5}, "top_p"),
    ({"top_k": 5}, "top_k"),
    ({"min_tokens": 2}, "min_tokens"),
    ({"presence_penalty": 1.0}, "presence_penalty"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"guided_choice": ["a", "b"]}, "use_beam_search"),
    ({"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),
])
def test_what_beam_search_cannot_honour_is_a_400(server, extra, param):
    response = post(server, prompt=list(PROMPT), max_tokens=3, n=2, **{"use_beam_search": True, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_temperature_0_a_seed_and_nulls_are_welcome(server):
    plain = post(server, prompt=list(PROMPT), max_tokens=3, n=2, use_beam_search=True, return_token_ids=True)
    same = post(server, prompt=list(PROMPT), max_tokens=3, n=2, use_beam_search=True, return_token_ids=True,
                temperature=0, seed=3, top_p=None, length_penalty=None)
    assert plain.status_code == same.status_code == 200
    assert [c["token_ids"] for c in plain.json()["choices"]] == [c["token_ids"] for c in same.json()["choices"]]
