"""A scripted model for contract tests: its next token follows a script chosen by the test.

It runs behind the real engine — scheduler, paged KV, sampler, stop classification — so tests
drive every layer but the weights. It keeps the context's token ids *in the KV cache* (one K
value per token), so a prefill → decode handoff only works if the blocks really moved. Every
position predicts (prompt scoring and speculative verification read more than the last one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from pegaserve.attention.backend import AttentionBatch, gather_context, store_kv
from pegaserve.models.config import ModelConfig

RUNNER_UP_LOGIT = 10.0  # what wins when the scripted token is masked (min_tokens)


def script_logit(position: int) -> float:
    """The scripted token's logit: it always wins, with a logprob (about -0.1 to -1.2 over the
    Qwen vocabulary) that differs by position, so tests can tell tokens' logprobs apart."""
    return 14.0 + 0.5 * (position % 5)


class ScriptedModel(nn.Module):
    """`script[prompt_ids]` is the sequence of tokens to generate after that prompt. Past the end
    of its script — or with no script — a context continues with `default_token_id`; when the
    scripted token is masked out of sampling, `runner_up_token_id` wins."""

    def __init__(
        self,
        base: ModelConfig,
        script: Mapping[Sequence[int], Sequence[int]],
        default_token_id: int = 64,  # "a"
        runner_up_token_id: int = 65,  # "b"
    ) -> None:
        super().__init__()
        self.config = dataclasses.replace(base, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
        self.script = {tuple(k): tuple(v) for k, v in script.items()}
        self.default_token_id = default_token_id
        self.runner_up_token_id = runner_up_token_id

    def next_token(self, context: Sequence[int]) -> int:
        context = tuple(context)
        best: tuple[int, ...] | None = None
        for prompt in self.script:
            if context[: len(prompt)] == prompt and (best is None or len(prompt) > len(best)):
                best = prompt
        if best is None:
            return self.default_token_id
        tokens = self.script[best]
        index = len(context) - len(best)
        return tokens[index] if index < len(tokens) else self.default_token_id

    def forward(self, input_ids, positions, kv_cache, batch: AttentionBatch) -> torch.Tensor:
        kv_layer = kv_cache[0]
        ids = input_ids.to(torch.float32)[:, None, None]  # [num_tokens, 1, 1]
        store_kv(ids, ids, kv_layer, batch.slot_mapping)
        hidden = torch.zeros(len(input_ids), 2)  # (next token id, its logit) at every row
        block_size = kv_layer.shape[2]
        for i, (q_len, ctx_len) in enumerate(zip(batch.query_lens, batch.context_lens_cpu)):
            blocks = batch.block_tables[i, : -(-ctx_len // block_size)]
            k_ctx, _ = gather_context(kv_layer, blocks, ctx_len)
            context = k_ctx[:, 0, 0].long().tolist()
            start = batch.query_starts[i]
            for j in range(q_len):
                num_seen = ctx_len - q_len + j + 1  # query j sees the context through its own token
                hidden[start + j, 0] = self.next_token(context[:num_seen])
                hidden[start + j, 1] = script_logit(num_seen)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = torch.zeros(hidden.shape[0], self.config.vocab_size)
        logits[:, self.runner_up_token_id] = RUNNER_UP_LOGIT
        logits.scatter_(1, hidden[:, :1].long(), hidden[:, 1:])
        return logits


def scripted_engine(model_dir, script: Mapping[Sequence[int], Sequence[int]], config=None):
    """An engine whose model follows `script` (see `ScriptedModel`), with the real tokenizer's vocab."""
    from pegaserve.config import EngineConfig  # noqa: PLC0415 - the engine imports nothing of ours
    from pegaserve.engine.core import EngineCore

    return EngineCore(ScriptedModel(ModelConfig.from_dir(model_dir), script), config or EngineConfig())


def build_from_recipe(recipe, script):
    """`EngineRecipe.builder` for an engine process running the scripted model."""
    return scripted_engine(recipe.model_dir, script, recipe.config)
