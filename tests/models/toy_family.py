"""A model family that exists only for tests: `ToyForCausalLM`, built from the shared layers the
way a real family is (pre-norm GQA with RoPE, gated MLP, untied LM head), its checkpoint written
here, and `reference_logits`, the same weights through dense causal attention with no cache.

Registered by the tests that use it (`register_model`), never by the product.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from pegaserve.attention.backend import AttentionBackend, AttentionSpec
from pegaserve.models.config import ModelConfig
from pegaserve.models.layers import GatedMLP, PagedAttention, RMSNorm, Rotary

ARCHITECTURE = "ToyForCausalLM"
TARGET = "tests.models.toy_family:ToyForCausalLM"
CONFIG = {
    "architectures": [ARCHITECTURE],
    "model_type": "toy",
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "eos_token_id": 0,
    "dtype": "float32",
}


class ToyAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend) -> None:
        super().__init__()
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = PagedAttention(
            backend, AttentionSpec(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scale=cfg.head_dim**-0.5)
        )

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        spec, num_tokens = self.attn.spec, x.shape[0]
        q = self.q_proj(x).view(num_tokens, spec.num_heads, spec.head_dim)
        k = self.k_proj(x).view(num_tokens, spec.num_kv_heads, spec.head_dim)
        v = self.v_proj(x).view(num_tokens, spec.num_kv_heads, spec.head_dim)
        return self.rotary(q, positions), self.rotary(k, positions), v

    def forward(self, x, positions, kv_layer, batch) -> torch.Tensor:
        q, k, v = self.qkv(x, positions)
        return self.o_proj(self.attn(q, k, v, kv_layer, batch).flatten(1))

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """Causal attention over `x` alone, with no cache: the reference."""
        q, k, v = self.qkv(x, torch.arange(x.shape[0]))
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            is_causal=True,
            scale=self.attn.spec.scale,
            enable_gqa=True,
        )
        return self.o_proj(out.transpose(0, 1).flatten(1))


class ToyLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = ToyAttention(cfg, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, positions, kv_layer, batch) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), positions, kv_layer, batch)
        return h + self.mlp(self.post_attention_layernorm(h))

    def dense(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn.dense(self.input_layernorm(h))
        return h + self.mlp(self.post_attention_layernorm(h))


class ToyForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_type)
        self.layers = nn.ModuleList(ToyLayer(cfg, rotary, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, positions, kv_cache, batch) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        for layer, kv_layer in zip(self.layers, kv_cache):
            h = layer(h, positions, kv_layer, batch)
        return self.norm(h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def reference_logits(self, token_ids: list[int]) -> torch.Tensor:
        """The last position's logits for `token_ids`, by dense attention (no paging, no cache)."""
        h = self.embed_tokens(torch.tensor(token_ids))
        for layer in self.layers:
            h = layer.dense(h)
        return self.compute_logits(self.norm(h)[-1:])[0]


def write_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    """config.json and model.safetensors of a seeded random `ToyForCausalLM` in `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(CONFIG))
    torch.manual_seed(seed)
    model = ToyForCausalLM(ModelConfig.from_dir(out_dir), AttentionBackendStub())
    for name, parameter in model.named_parameters():
        if name.endswith("norm.weight"):
            nn.init.normal_(parameter, 1.0, 0.1)  # not all ones: a norm that ignored its weight would show
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out_dir / "model.safetensors"))
    return out_dir


class AttentionBackendStub(AttentionBackend):
    """For building the model to draw its weights; never attends."""

    name = "stub"

    def forward(self, q, k, v, kv_layer, batch, spec):
        raise AssertionError("the stub backend only builds models")
