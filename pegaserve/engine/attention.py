"""Attention over the paged KV cache, behind a small backend interface.

The model calls `backend.forward(...)` once per layer; the backend writes the step's new K/V into
the cache by slot mapping, then attends each query over its request's whole context (cached prefix
plus the new tokens). `sdpa` is the torch reference; `triton` (kernels/) and `flash` plug in here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class AttentionBatch:
    """Where a step's tokens sit in the paged cache. Built by the model runner, read by backends.

    Tokens of one request are contiguous in the flattened step; request i owns `query_lens[i]` of
    them, and after this step its context holds `context_lens[i]` tokens (cached + new).
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot = block_id * block_size + offset
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [num_reqs] int64
    query_lens: tuple[int, ...]
    context_lens_cpu: tuple[int, ...]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        batch: AttentionBatch,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Store k/v at `batch.slot_mapping`, then causal attention of q over each context."""


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_slots = kv_layer.shape[1] * kv_layer.shape[2]
    flat = kv_layer.view(2, num_slots, *kv_layer.shape[3:])  # [2, num_slots, kvh, hd]
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def gather_context(kv_layer: torch.Tensor, block_ids: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's cached K and V as `[num_tokens, kvh, hd]` each."""
    blocks = kv_layer[:, block_ids]  # [2, nb, bs, kvh, hd]
    flat = blocks.reshape(2, -1, *blocks.shape[3:])[:, :num_tokens]
    return flat[0], flat[1]


class SdpaBackend(AttentionBackend):
    """torch scaled_dot_product_attention: one padded call for decode, one call per prompt otherwise."""

    name = "sdpa"

    def forward(self, q, k, v, kv_layer, batch, scale):
        store_kv(k, v, kv_layer, batch.slot_mapping)
        if batch.is_decode:
            return self._decode(q, kv_layer, batch, scale)
        return self._prefill(q, k, v, kv_layer, batch, scale)

    def _decode(self, q, kv_layer, batch, scale):
        num_reqs, max_blocks = batch.block_tables.shape
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
        # index_select over whole blocks copies 8 KB rows; advanced indexing is ~1.5x slower here
        blocks = kv_layer.view(2, num_blocks, -1).index_select(1, batch.block_tables.view(-1))
        ctx = blocks.view(2, num_reqs, max_blocks * block_size, num_kv_heads, head_dim)
        ctx = ctx.transpose(2, 3)  # [2, B, kvh, L, hd]
        positions = torch.arange(ctx.shape[3], device=q.device)
        mask = (positions[None, :] < batch.context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], ctx[0], ctx[1], attn_mask=mask, scale=scale, enable_gqa=True
        )  # [B, H, 1, hd]
        return out[:, :, 0, :]

    def _prefill(self, q, k, v, kv_layer, batch, scale):
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, ctx_len) in enumerate(zip(batch.query_lens, batch.context_lens_cpu)):
            if q_len == ctx_len:  # a fresh prompt: its whole context is this step's own K/V
                k_ctx, v_ctx = k[start : start + q_len], v[start : start + q_len]
                mask, causal = None, True
            else:  # continuing after a cached prefix: query j sits at position ctx_len - q_len + j
                num_blocks = -(-ctx_len // kv_layer.shape[2])
                k_ctx, v_ctx = gather_context(kv_layer, batch.block_tables[i, :num_blocks], ctx_len)
                rows = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
                mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows[:, None]
                causal = False
            # with a batch dimension (4-D) CPU SDPA takes its flash kernel; 3-D inputs take the math path
            o = F.scaled_dot_product_attention(
                q[start : start + q_len].transpose(0, 1)[None],  # [1, H, q_len, hd]
                k_ctx.transpose(0, 1)[None], v_ctx.transpose(0, 1)[None],
                attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
            )  # fmt: skip
            out[start : start + q_len] = o[0].transpose(0, 1)
            start += q_len
        return out


def make_backend(name: str) -> AttentionBackend:
    """`auto` picks triton on CUDA when it imports, else sdpa."""
    if name == "sdpa" or (name == "auto" and not torch.cuda.is_available()):
        return SdpaBackend()
    if name in ("triton", "auto"):
        try:
            from pegaserve_kernels.backend import TritonBackend  # noqa: PLC0415 - optional GPU path
        except ImportError:
            if name == "triton":
                raise
            return SdpaBackend()
        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}: expected auto, sdpa or triton")
