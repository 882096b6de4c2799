"""Greedy parity with transformers' Qwen3ForCausalLM on the same weights (fp32)."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from pegaserve.config import EngineConfig, Role
from pegaserve.cpu import lm_head
from pegaserve.engine.build import load_engine
from tests.helpers import PROMPTS, greedy_request, run_to_completion, token_ids

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dir) -> list[list[int]]:
    hf = Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in PROMPTS:  # a plain greedy loop: generate() would stop at (or mask) EOS
            ids, past, generated = torch.tensor([prompt]), None, []
            for _ in range(NEW_TOKENS):
                out = hf(input_ids=ids, past_key_values=past, use_cache=True)
                past = out.past_key_values
                generated.append(int(out.logits[0, -1].argmax()))
                ids = torch.tensor([[generated[-1]]])
            results.append(generated)
    return results


def test_batched_greedy_equals_transformers(tiny_model_dir, reference_tokens):
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=256, block_size=16), attention_backend="sdpa")
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(greedy_request(f"r{i}", prompt, NEW_TOKENS))
    outputs = run_to_completion(engine)
    for i in range(len(PROMPTS)):
        assert token_ids(outputs[f"r{i}"]) == reference_tokens[i], f"prompt {i}"
    engine.pool.check_conservation()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("logprobs", [None, 0])
def test_decode_steps_of_argmax_rows_take_the_screened_head(tiny_model_dir, reference_tokens, monkeypatch, logprobs):
    """Steps whose every row wants the argmax alone find it with the model's screened head (an fp16
    copy of the weight, where the kernel runs), the same tokens; a row that wants its logprob keeps
    its step on the full logits."""
    engine = load_engine(tiny_model_dir, EngineConfig(num_blocks=256, block_size=16), attention_backend="sdpa")
    found = []
    argmax = lm_head.ScreenedHead.argmax
    monkeypatch.setattr(
        lm_head.ScreenedHead, "argmax", lambda head, hidden: found.append(argmax(head, hidden)) or found[-1]
    )
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(greedy_request(f"r{i}", prompt, NEW_TOKENS, num_top_logprobs=logprobs))
    outputs = run_to_completion(engine)

    assert [token_ids(outputs[f"r{i}"]) for i in range(len(PROMPTS))] == reference_tokens
    if logprobs is not None:
        assert not found
        assert all(t.logprob is not None for out in outputs.values() for o in out for t in o.tokens)
    else:
        assert (len(found) >= NEW_TOKENS) == lm_head.has_kernel()  # every step where it runs, the first too
        assert all(t.logprob is None for out in outputs.values() for o in out for t in o.tokens)  # none asked


@pytest.mark.parametrize("role", [Role.PREFILL, Role.BOTH])
def test_every_engine_builds_the_screened_head_as_it_starts(tiny_model_dir, role):
    """A prefill engine's first tokens come through the screened head as a decode engine's next
    ones do (a seeded draw is the same on either), and it is built as the engine starts, not in its
    first step (where the kernel runs)."""
    engine = load_engine(tiny_model_dir, EngineConfig(role=role, num_blocks=64), attention_backend="sdpa")
    model = engine.runner.model

    def built() -> bool:  # (the model keeps (head, screened head or None) once asked)
        return model._screened is not None and model._screened[1] is not None

    built_at_start = built()
    engine.add_request(greedy_request("r", PROMPTS[1], 4))
    for _ in range(4):
        engine.step()

    assert built_at_start == built() == lm_head.has_kernel()
