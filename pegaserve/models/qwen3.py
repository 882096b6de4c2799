"""Qwen3 in torch, in forward order, with Hugging Face parameter names; the layers it shares with
other families come from `layers`.

No serving logic lives here: the model sees a flattened step of tokens (`input_ids`, `positions`)
and an `AttentionBatch` saying where their K/V go; it returns hidden states. Logits are computed
only for the rows the caller asks for.
"""

from __future__ import annotations

import torch
from torch import nn

from pegaserve.attention.backend import AttentionBackend, AttentionBatch, AttentionSpec
from pegaserve.cpu.lm_head import CpuLogits, ScreenedHead
from pegaserve.models.config import ModelConfig
from pegaserve.models.layers import FusedLinear, GatedMLP, PagedAttention, RMSNorm, Rotary, qk_norm_rope


class Qwen3Attention(nn.Module):
    """GQA with a per-head RMSNorm of q and k before RoPE (Qwen3's one change to Llama's)."""

    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = rotary
        spec = AttentionSpec(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scale=cfg.head_dim**-0.5)
        self.attn = PagedAttention(backend, spec)
        self.qkv = FusedLinear(self.q_proj, self.k_proj, self.v_proj)  # one GEMM, the same three outputs
        self.out = FusedLinear(self.o_proj)

    def forward(self, x, positions, kv_layer, batch: AttentionBatch) -> torch.Tensor:
        num_tokens = x.shape[0]  # x: [num_tokens, hidden]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((q_size, kv_size, kv_size), dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)  # [num_tokens, heads, head_dim]
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)  # [num_tokens, kv_heads, head_dim]
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = qk_norm_rope(q, k, self.q_norm, self.k_norm, self.rotary, positions, self.attn.backend.qk_norm_rope)
        out = self.attn(q, k, v, kv_layer, batch)  # [num_tokens, heads, head_dim]
        return self.out(out.reshape(num_tokens, q_size))  # [num_tokens, hidden]


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Qwen3Attention(cfg, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, positions, kv_layer, batch):
        h = h + self.self_attn(self.input_layernorm(h), positions, kv_layer, batch)  # the residual stream
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, cfg.rope_type)  # one table, shared
        self.layers = nn.ModuleList(Qwen3DecoderLayer(cfg, rotary, backend) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_cache, batch):
        h = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        for layer, kv_layer in zip(self.layers, kv_cache):
            h = layer(h, positions, kv_layer, batch)
        return self.norm(h)


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg, backend)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._cpu_logits: CpuLogits | None = None  # built from lm_head.weight on first use
        self._screened: tuple[CpuLogits, ScreenedHead | None] | None = None  # built on first use, for that head

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        batch: AttentionBatch,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        return self.model(input_ids, positions, kv_cache, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self._cpu_lm_head()
        if head is not None:
            return head(hidden)  # [rows, vocab]
        return self.lm_head(hidden).float()  # [rows, vocab]

    def screened_head(self) -> ScreenedHead | None:
        """The head read through an fp16 copy of its weight (`lm_head.ScreenedHead`: half the bytes,
        and as much memory again), bounding or matching `compute_logits` exactly, where the CPU
        kernel runs; else None. Built on first use (the runner of an engine that decodes asks for it as
        it starts; a prefill-only engine never does)."""
        head = self._cpu_lm_head()
        if head is None:
            return None
        if self._screened is None or self._screened[0] is not head:
            self._screened = (head, ScreenedHead.of(head))
        return self._screened[1]

    def _cpu_lm_head(self) -> CpuLogits | None:
        """The LM head with its weight packed for the CPU kernel, for fp32 on the CPU (else None).

        The head (vocab x hidden, ~150k rows) is most of a small model's decode step; the packed
        copy (`lm_head.py`) is ~1.7x faster than oneDNN's at 16 rows and gives the same fp32 dot
        products. It is built on first use and rebuilt if the weight is replaced (the loader
        assigns and re-ties weights after construction).
        """
        weight = self.lm_head.weight
        if not CpuLogits.supports(weight):
            return None
        if self._cpu_logits is None or self._cpu_logits.weight is not weight:
            self._cpu_logits = CpuLogits(weight)
        return self._cpu_logits
