"""No parameter silently ignored: every field of the request models (nested ones too) is either
implemented — with a behaviour test named in `BEHAVIOUR` — accepted with no effect by definition
(`NO_EFFECT`), or refused with a 400 naming it when set to a non-default value (`REFUSED`); the
kinds are listed in field_kinds.py. A new
field fails `test_every_field_is_accounted_for` until it is one of the three. Also here: the
behaviour tests of the smaller fields that have no other home."""

from __future__ import annotations

import importlib
import json
import typing

import httpx
import pytest
from pydantic import BaseModel

from pegaserve.api.app import build_app
from pegaserve.api.jobs import render_chat
from pegaserve.api.protocol import (
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    REFUSED_RESPONSES,
    ChatMessage,
    ResponsesRequest,
)
from pegaserve.config import EngineConfig
from pegaserve.standalone import build_local_frontend
from pegaserve.testing.scripted import scripted_engine
from pegaserve.tokenizer import Tokenizer
from tests.api.field_kinds import BEHAVIOUR, MODELS, NO_EFFECT, REFUSED_VALUES
from tests.api.helpers import PROMPT, scripted_frontend, sse_chunks
from tests.contract.server import ThreadedServer


def all_fields(model: type[BaseModel]) -> set[str]:
    """A model's fields, and those of the models its fields hold (`messages.role`...)."""
    names = set(model.model_fields)
    for outer, info in model.model_fields.items():
        names |= {f"{outer}.{inner}" for nested in _models_in(info.annotation) for inner in nested.model_fields}
    return names


def _models_in(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def test_every_field_is_accounted_for():
    refused = set(REFUSED_COMPLETION) | set(REFUSED_CHAT) | set(REFUSED_RESPONSES)
    assert refused == set(REFUSED_VALUES)
    for endpoint, model in {**MODELS, "responses": ResponsesRequest}.items():
        unaccounted = all_fields(model) - set(BEHAVIOUR) - set(NO_EFFECT) - refused
        assert not unaccounted, f"{endpoint}: fields neither tested, nor without effect, nor refused: {unaccounted}"


def test_every_behaviour_test_exists():
    for name, tests in BEHAVIOUR.items():
        for test in tests:
            module, function = test.split("::")
            assert callable(getattr(importlib.import_module(f"tests.api.{module}"), function, None)), (name, test)


def post(server, endpoint: str, **body) -> httpx.Response:
    path = "/v1/completions" if endpoint == "completions" else "/v1/chat/completions"
    base = {"prompt": PROMPT} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    return httpx.post(f"{server.base_url}{path}", content=json.dumps({**base, "max_tokens": 3, **body}),
                      headers={"content-type": "application/json"}, timeout=60)


REFUSALS = [(e, name) for e, names in (("completions", REFUSED_COMPLETION), ("chat", REFUSED_CHAT)) for name in names]


@pytest.mark.parametrize("endpoint,name", REFUSALS, ids=[f"{e}-{n}" for e, n in REFUSALS])
def test_refused_fields_are_a_400_naming_them(server, endpoint, name):
    response = post(server, endpoint, **{name: REFUSED_VALUES[name]})
    assert response.status_code == 400 and response.json()["error"]["param"] == name, response.text
    assert post(server, endpoint, **{name: None}).status_code == 200  # null: the default


NO_EFFECTS = [(e, n) for e, model in MODELS.items() for n in NO_EFFECT if n in model.model_fields]


@pytest.mark.parametrize("endpoint,name", NO_EFFECTS, ids=[f"{e}-{n}" for e, n in NO_EFFECTS])
def test_fields_without_effect_change_nothing(server, endpoint, name):
    plain = post(server, endpoint, temperature=0, return_token_ids=True).json()
    other = post(server, endpoint, temperature=0, return_token_ids=True, **{name: NO_EFFECT[name]}).json()
    assert plain["choices"] == other["choices"] and plain["usage"] == other["usage"]


# --- behaviour of the smaller fields -------------------------------------------------------------------


def test_return_tokens_as_token_ids(server):
    body = post(server, "completions", logprobs=1, temperature=0, return_tokens_as_token_ids=True).json()
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:64", "token_id:293", "token_id:272"]
    assert list(logprobs["top_logprobs"][0]) == ["token_id:64"]
    chat = post(server, "chat", logprobs=True, top_logprobs=1, temperature=0, return_tokens_as_token_ids=True).json()
    assert all(e["token"].startswith("token_id:") for e in chat["choices"][0]["logprobs"]["content"])


def test_continuous_usage_stats(server):
    chunks = sse_chunks(post(server, "completions", stream=True, temperature=0, n=2,
                             stream_options={"include_usage": True, "continuous_usage_stats": True}).text)
    per_choice = [c for c in chunks if c["choices"]]
    assert all(c["usage"]["prompt_tokens"] == len(PROMPT) for c in per_choice)
    for index in (0, 1):
        counts = [c["usage"]["completion_tokens"] for c in per_choice if c["choices"][0]["index"] == index]
        assert counts == sorted(counts) and counts[-1] == 3
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_truncate_prompt_tokens(server):
    long_prompt = [*PROMPT[:1], 5, 6, 7, *PROMPT]
    left = post(server, "completions", prompt=long_prompt, truncate_prompt_tokens=3, temperature=0,
                return_token_ids=True).json()
    assert left["choices"][0]["prompt_token_ids"] == PROMPT and left["choices"][0]["text"] == "a b c"
    right = post(server, "completions", prompt=long_prompt, truncate_prompt_tokens=2, truncation_side="right",
                 return_token_ids=True).json()
    assert right["choices"][0]["prompt_token_ids"] == long_prompt[:2] and right["usage"]["prompt_tokens"] == 2
    whole = post(server, "completions", prompt=long_prompt, truncate_prompt_tokens=-1, return_token_ids=True).json()
    assert whole["choices"][0]["prompt_token_ids"] == long_prompt


def test_top_p_and_top_k_narrow_sampling(server):
    # The scripted token holds ~89% of the mass and the runner-up next: either filter keeps only it.
    for narrow in ({"top_p": 0.5}, {"top_k": 1}):
        texts = {post(server, "completions", temperature=1.0, seed=s, **narrow).json()["choices"][0]["text"]
                 for s in range(8)}
        assert texts == {"a b c"}, narrow
    wide = {post(server, "completions", temperature=2.0, seed=s).json()["choices"][0]["text"] for s in range(8)}
    assert len(wide) > 1


def test_a_text_response_format_is_plain_text(server):
    plain = post(server, "chat", temperature=0).json()
    assert post(server, "chat", temperature=0, response_format={"type": "text"}).json()["choices"] == plain["choices"]


def test_the_body_request_id_is_the_correlation_id(server):
    response = post(server, "completions", request_id="body-id-7")
    body = response.json()
    assert body["id"] != "body-id-7" and response.headers["x-request-id"] == "body-id-7"
    record = httpx.get(f"{server.base_url}/admin/ledger/{body['id']}").json()
    assert record["client_request_id"] == "body-id-7"
    both = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 1,
                                                                 "request_id": "body"},
                      headers={"X-Request-Id": "header"})
    assert both.headers.get_list("x-request-id") == ["header"]  # the header wins


def test_allowed_token_ids_are_the_only_tokens_sampled(server):
    def token_ids(endpoint: str, **body) -> list[int]:
        response = post(server, endpoint, return_token_ids=True, **body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    assert token_ids("completions", temperature=0) == [64, 293, 272]  # the script
    # the script's token masked, the runner-up 65 (logit 10) beats the rest (0)
    assert token_ids("completions", temperature=0, allowed_token_ids=[65, 66]) == [65, 65, 65]
    assert token_ids("chat", temperature=0, allowed_token_ids=[70, 65]) == [65, 65, 65]
    assert token_ids("completions", temperature=0, allowed_token_ids=[293, 70]) == [70, 293, 70]
    assert set(token_ids("completions", seed=1, allowed_token_ids=[66, 67], max_tokens=16)) == {66, 67}
    for bad, why in (([], "at least one"), ([5, 10**9], "outside the vocabulary")):
        refused = post(server, "completions", allowed_token_ids=bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "allowed_token_ids", refused.text
        assert why in refused.json()["error"]["message"]
    held_back = post(server, "completions", allowed_token_ids=[66], stop_token_ids=[66], min_tokens=1)
    assert held_back.status_code == 400 and held_back.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_are_never_completed(server):
    def token_ids(endpoint: str, **body) -> list[int]:
        response = post(server, endpoint, temperature=0, return_token_ids=True, **body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    # the script: 64 "a", 293 " b", 272 " c"; the runner-up 65 "b", the rest 0 (the first of them: 0)
    assert token_ids("completions", bad_words=["b"]) == [64, 0, 272]  # "b" and " b" alike
    assert token_ids("completions", bad_words=["a b"]) == [64, 65, 272]  # " b" only right after "a"
    assert token_ids("completions", bad_words=["  a b", "c"]) == [64, 65, 65]  # " c" masked: the runner-up
    assert token_ids("chat") == [64, 64, 64] and token_ids("chat", bad_words=["a"]) == [65, 65, 65]  # no script
    assert token_ids("completions", bad_words=["b a"]) == [64, 293, 272]  # never formed: nothing changes
    for bad in (["  "], [""], ["x"] * 129, ["y" * 257]):
        refused = post(server, "completions", bad_words=bad)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words", refused.text


def test_cache_salt_keeps_cached_prompts_apart(tiny_model_dir):
    engine = scripted_engine(tiny_model_dir, {})
    prompt = list(range(1000, 1040))  # two full blocks of 16 (the third holds the last token)

    def new_hits(**salt) -> int:
        before = engine.stats().prefix_cache_hit_tokens
        response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 2, **salt})
        assert response.status_code == 200, response.text
        return engine.stats().prefix_cache_hit_tokens - before

    with ThreadedServer(build_app(build_local_frontend(engine=engine))) as server:
        assert new_hits(cache_salt="a") == 0
        assert new_hits(cache_salt="a") == 32
        assert new_hits(cache_salt="b") == 0
        assert new_hits() == 0 and new_hits(cache_salt=None) == 32  # null: unsalted
        empty = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": prompt, "cache_salt": ""})
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "cache_salt"


def test_priority_reaches_the_engine_only_under_the_priority_policy(server, tiny_model_dir):
    body = {"prompt": PROMPT, "max_tokens": 2}
    refused = httpx.post(f"{server.base_url}/v1/completions", json={**body, "priority": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority"
    assert "scheduling_policy" in refused.json()["error"]["message"]
    assert httpx.post(f"{server.base_url}/v1/completions", json={**body, "priority": 0}).status_code == 200
    config = EngineConfig(scheduling_policy="priority")
    engine = scripted_engine(tiny_model_dir, {}, config)
    seen, add = [], engine.add_request
    engine.add_request = lambda spec: (seen.append(spec.priority), add(spec))[1]
    with ThreadedServer(build_app(build_local_frontend(engine=engine, engine_config=config))) as ranked:
        assert httpx.post(f"{ranked.base_url}/v1/completions", json={**body, "priority": -3}).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "priority": 7}
        assert httpx.post(f"{ranked.base_url}/v1/chat/completions", json=chat).status_code == 200
        huge = httpx.post(f"{ranked.base_url}/v1/completions", json={**body, "priority": 2**70})
        assert huge.status_code == 400 and huge.json()["error"]["param"] == "priority"
    assert seen == [-3, 7]


def test_a_predicted_output_changes_no_greedy_token_and_bad_ones_are_a_400(tiny_model_dir):
    tokenizer = Tokenizer(tiny_model_dir)
    text = " the quick brown fox jumps over the lazy dog, and over the lazy dog again"
    answer = tokenizer.backend.encode(text, add_special_tokens=False).ids
    messages = [{"role": "user", "content": "hi"}]
    prompt = tokenizer.backend.encode(render_chat(tokenizer, [ChatMessage(**m) for m in messages], True, False, None),
                                      add_special_tokens=False).ids
    engine = scripted_engine(tiny_model_dir, {tuple(prompt): answer})
    chat = {"messages": messages, "max_tokens": len(answer), "return_token_ids": True, "temperature": 0}
    with ThreadedServer(build_app(build_local_frontend(engine=engine))) as running:
        def ask(**body) -> httpx.Response:
            return httpx.post(f"{running.base_url}/v1/chat/completions", json={**chat, **body})

        plain_body = ask().json()
        plain = plain_body["choices"][0]
        assert plain["token_ids"] == answer and "completion_tokens_details" not in plain_body["usage"]
        half = len(text) // 2
        stats = engine.scheduler.drafter.stats
        for content in (text, [{"type": "text", "text": text[:half]}, {"type": "text", "text": text[half:]}],
                        " the quick brown cat sleeps"):
            before = (stats.num_accepted_tokens, stats.num_draft_tokens)
            body = ask(prediction={"type": "content", "content": content}).json()
            predicted = body["choices"][0]
            assert predicted["token_ids"] == plain["token_ids"] and predicted["message"] == plain["message"]
            accepted = stats.num_accepted_tokens - before[0]
            if content != " the quick brown cat sleeps":
                assert accepted >= len(answer) // 2  # drafts taken
            # OpenAI's usage details: the prediction's drafts kept, and those verified and turned away
            details = body["usage"]["completion_tokens_details"]
            assert details == {"accepted_prediction_tokens": accepted,
                               "rejected_prediction_tokens": stats.num_draft_tokens - before[1] - accepted}
            chunks = sse_chunks(ask(prediction={"type": "content", "content": content}, stream=True,
                                    stream_options={"include_usage": True}).text)
            assert chunks[-1]["usage"] == body["usage"]
        assert 0 < details["rejected_prediction_tokens"]  # the cat
        for bad in ({"type": "content"}, {"type": "diff", "content": "a"}, "aaa",
                    {"type": "content", "content": [{"type": "image_url"}]}):
            refused = ask(prediction=bad)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "prediction", bad
        for beside in ({"guided_choice": ["a"]}, {"use_beam_search": True}):
            refused = ask(prediction={"type": "content", "content": "a"}, **beside)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "prediction", beside


def test_add_special_tokens_is_the_tokenizers(server, tiny_model_dir):
    tokenizer = Tokenizer(tiny_model_dir)
    for flag in (True, False):
        body = post(server, "completions", prompt="Hello there", add_special_tokens=flag, return_token_ids=True).json()
        assert body["choices"][0]["prompt_token_ids"] == tokenizer.backend.encode("Hello there",
                                                                                  add_special_tokens=flag).ids


def test_tool_choice_without_tools(server):
    for choice in ("none", "auto", None):
        assert post(server, "chat", tool_choice=choice).status_code == 200
    assert post(server, "chat", tool_choice="auto", tools=[{"type": "function"}]).status_code == 400


def test_text_is_the_only_modality(server):
    assert post(server, "chat", modalities=["text"]).status_code == 200
    assert post(server, "chat", modalities=["audio"]).json()["error"]["param"] == "modalities"


def test_a_chat_response_carries_its_prompt_ids_whatever_n(server):
    for n in (1, 2):
        body = post(server, "chat", n=n, temperature=0, return_token_ids=True).json()
        tokens = httpx.post(f"{server.base_url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert body["prompt_token_ids"] == tokens.json()["tokens"], n
    several = post(server, "completions", prompt=[PROMPT, PROMPT[:2]], return_token_ids=True).json()
    assert several["prompt_token_ids"] is None  # choices of different prompts
    one = post(server, "completions", n=2, return_token_ids=True).json()
    assert one["prompt_token_ids"] == PROMPT


def test_behind_serve_the_body_request_id_beats_the_header_serve_made_up(tiny_model_dir):
    # Serve (its proxy, or HAProxy in front of it) sets X-Request-Id on every request it forwards
    served = build_app(scripted_frontend(tiny_model_dir, {}), echo_request_id=False)
    made_up = {"X-Request-Id": "6a7acc43-made-up-by-serve"}
    with ThreadedServer(served) as running:
        def client_id(path: str, **body) -> str:
            chat = path == "/v1/chat/completions"
            base = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": PROMPT}
            answer = httpx.post(f"{running.base_url}{path}", json={**base, "max_tokens": 1, **body}, headers=made_up)
            return httpx.get(f"{running.base_url}/admin/ledger/{answer.json()['id']}").json()["client_request_id"]

        for path in ("/v1/completions", "/v1/chat/completions"):
            assert client_id(path, request_id="body-id-8") == "body-id-8"
            assert client_id(path) == made_up["X-Request-Id"]
        too_long = httpx.post(f"{running.base_url}/v1/completions", headers=made_up,
                              json={"prompt": PROMPT, "max_tokens": 1, "request_id": "r" * 300})
        assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "request_id"


def test_continuous_usage_stats_count_no_token_in_the_role_chunk(server):
    chunks = sse_chunks(post(server, "chat", stream=True, temperature=0, n=2,
                             stream_options={"include_usage": True, "continuous_usage_stats": True}).text)
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert len(roles) == 2 and all(c["usage"]["completion_tokens"] == 0 for c in roles)
    shown = [c for c in chunks if c["choices"] and "role" not in c["choices"][0]["delta"]]
    assert all(c["usage"]["completion_tokens"] >= 1 for c in shown)
