"""Greedy parity with transformers' Qwen3ForCausalLM on the same weights (fp32)."""

import pytest
import torch
from transformers import Qwen3ForCausalLM

from pegaserve.engine.build import load_engine
from pegaserve.engine.engine import EngineConfig
from tests.engine.helpers import PROMPTS, greedy_request, run_to_completion, token_ids

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
