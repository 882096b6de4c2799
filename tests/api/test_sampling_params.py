"""Penalties, logit_bias, min_p and the greedy threshold on the standalone frontend with qwen3-tiny's
real weights, against a reference: transformers' Qwen3ForCausalLM logits with each rule applied by
hand, then the argmax. And every new parameter's range: a 400 naming it."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import torch

PROMPT = [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]
TOKENS = 8


@pytest.fixture(scope="module")
def server(real_server):
    return real_server


def reference(hf, steps: int = TOKENS, repetition: float = 1.0, presence: float = 0.0, frequency: float = 0.0,
              bias: dict[int, float] | None = None) -> list[int]:
    """Greedy tokens with vLLM's processing order: bias, repetition (prompt + output), then
    frequency and presence (output)."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = hf(input_ids=torch.tensor([PROMPT + out])).logits[0, -1].clone()
            for token_id, value in (bias or {}).items():
                logits[token_id] += value
            if repetition != 1.0:
                seen = torch.tensor(sorted(set(PROMPT + out)))
                values = logits[seen]
                logits[seen] = torch.where(values > 0, values / repetition, values * repetition)
            for token_id, count in Counter(out).items():
                logits[token_id] -= frequency * count + presence
            out.append(int(logits.argmax()))
    return out


def generate(server, **params) -> list[int]:
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "return_token_ids": True, "temperature": 0,
            **params}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["token_ids"]


def test_greedy_without_processing_is_the_reference(server, hf):
    assert generate(server) == reference(hf)


@pytest.mark.parametrize("penalty", [
    {"repetition_penalty": 1.8}, {"repetition_penalty": 0.5}, {"presence_penalty": 1.5},
    {"frequency_penalty": 2.0}, {"presence_penalty": -2.0}, {"frequency_penalty": 1.0, "presence_penalty": 0.5,
                                                               "repetition_penalty": 1.3},
], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_penalties_equal_the_reference(server, hf, penalty):
    expected = reference(hf, repetition=penalty.get("repetition_penalty", 1.0),
                         presence=penalty.get("presence_penalty", 0.0), frequency=penalty.get("frequency_penalty", 0.0))
    assert generate(server, **penalty) == expected


def test_a_plus_100_bias_forces_a_token(server):
    assert generate(server, logit_bias={"42": 100}) == [42] * TOKENS


def test_a_minus_100_bias_bans_the_greedy_token(server, hf):
    greedy = reference(hf)
    banned = {str(t): -100 for t in set(greedy)}
    tokens = generate(server, logit_bias=banned)
    assert not set(tokens) & set(greedy)
    assert tokens == reference(hf, bias={t: -100.0 for t in set(greedy)})


def test_min_p_1_keeps_only_the_best_token(server, hf):
    greedy = reference(hf)
    assert all(generate(server, temperature=1.0, seed=s, min_p=1.0) == greedy for s in range(3))
    assert any(generate(server, temperature=1.0, seed=s) != greedy for s in range(3))  # without it: sampled


@pytest.mark.parametrize("temperature", [1e-6, 1e-9, 1e-30, 1e-45, 5e-324, 0.0, -0.0])
def test_a_temperature_below_1e_5_is_greedy(server, hf, temperature):
    assert generate(server, temperature=temperature, seed=3) == reference(hf)


def test_top_k_1_is_greedy(server, hf):
    assert generate(server, temperature=1.5, top_k=1, seed=3) == reference(hf)


def test_a_tiny_repetition_penalty_stays_finite(server, hf):
    tokens = generate(server, repetition_penalty=1e-300, logprobs=1)
    assert tokens == generate(server, repetition_penalty=1e-6)  # the floor: it acts as 1e-6


# --- every range: a 400 naming the parameter ---------------------------------------------------------

BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": -1e308}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.5}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {"151936": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "x"}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": 1e308}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -5e-324}, "top_p"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"n": -1}, "n"),
    ({"n": 129}, "n"),
    ({"n": "2"}, "n"),
    ({"seed": 2**63}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"best_of": 0}, "best_of"),
    ({"best_of": 2, "n": 3}, "best_of"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncation_side": "middle"}, "truncation_side"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"schema": {}}}, "response_format"),
    ({"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ({"echo": "yes"}, "echo"),
    ({"add_special_tokens": 1}, "add_special_tokens"),
    ({"return_tokens_as_token_ids": "true"}, "return_tokens_as_token_ids"),
    ({"request_id": "x" * 257}, "request_id"),
]


@pytest.mark.parametrize("patch,param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_completion_is_400_naming_the_param(server, patch, param):
    body = {"model": "qwen3-tiny", "prompt": PROMPT, "max_tokens": 2, **patch}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["message"]


BAD_CHAT = [
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"store": "yes"}, "store"),
    ({"store": True, "metadata": {"k" * 65: "v"}}, "metadata"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"metadata": {"k": 5}}, "metadata"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"max_tokens": 0, "echo": True}, "max_tokens"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"request_id": "y" * 300}, "request_id"),
]


@pytest.mark.parametrize("patch,param", BAD_CHAT, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_CHAT)])
def test_bad_chat_is_400_naming_the_param(server, patch, param):
    body = {"model": "qwen3-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **patch}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_overlong_x_request_id_is_a_400_naming_it(server):
    body = {"prompt": PROMPT, "max_tokens": 2}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, headers={"X-Request-Id": "z" * 300})
    assert response.status_code == 400 and response.json()["error"]["param"] == "X-Request-Id"
