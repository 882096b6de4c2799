"""Qwen3 in torch, in forward order, with Hugging Face parameter names.

No serving logic lives here: the model sees a flattened step of tokens (`input_ids`, `positions`)
and an `AttentionBatch` saying where their K/V go; it returns hidden states. Logits are computed
only for the rows the caller asks for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pegaserve.attention.backend import AttentionBackend, AttentionBatch
from pegaserve.cpu.lm_head import CpuLogits, ScreenedHead
from pegaserve.models.config import ModelConfig
from pegaserve.models.fused_linear import FusedLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotate-half RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, heads, head_dim]
        cos = self.cos[positions][:, None, :].to(x.dtype)
        sin = self.sin[positions][:, None, :].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
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
        self.backend = backend
        self.qkv = FusedLinear(self.q_proj, self.k_proj, self.v_proj)  # one GEMM, the same three outputs
        self.out = FusedLinear(self.o_proj)

    def forward(self, x, positions, kv_layer, batch: AttentionBatch) -> torch.Tensor:
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((q_size, kv_size, kv_size), dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.backend.qk_norm_rope(q, k, self.q_norm, self.k_norm, self.rotary, positions)  # norm, then RoPE
        out = self.backend.forward(q, k, v, kv_layer, batch, scale=self.head_dim**-0.5)
        return self.out(out.reshape(num_tokens, q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up = FusedLinear(self.gate_proj, self.up_proj)
        self.down = FusedLinear(self.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: Rotary, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h, positions, kv_layer, batch):
        h = h + self.self_attn(self.input_layernorm(h), positions, kv_layer, batch)
        return h + self.mlp(self.post_attention_layernorm(h))


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, backend) for _ in range(cfg.num_layers))
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
