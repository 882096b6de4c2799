"""Attention over the paged KV cache, behind a small backend interface.

A model calls `backend.forward(...)` once per layer (through `pegaserve.models.layers.PagedAttention`);
the backend writes the step's new K/V into the cache by slot mapping, then attends each query over
its request's whole context (cached prefix plus the new tokens). A step may mix requests: decode
tokens (one query each, or a few with speculative drafts) and prefill chunks (many queries,
continuing after any cached prefix). `sdpa` is the torch reference; backends are chosen by name
(`pegaserve.attention.registry`), `triton` (pegaserve.kernels) among them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

import torch
import torch.nn.functional as F

from pegaserve.attention import cpu_paged


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

    @cached_property
    def query_starts(self) -> tuple[int, ...]:
        """Where each request's queries start in the flattened step."""
        starts, total = [], 0
        for n in self.query_lens:
            starts.append(total)
            total += n
        return tuple(starts)


@dataclass(frozen=True)
class AttentionSpec:
    """What one attention layer computes, as its model declares it (once, as it is built).

    `logit_soft_cap` (Gemma 2's `cap * tanh(scores / cap)`) and `sliding_window` (attend to the
    last `sliding_window` keys only) are declared here so that a backend can refuse them: none of
    today's backends computes either.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # applied to q·k before the softmax
    logit_soft_cap: float | None = None
    sliding_window: int | None = None


class UnsupportedAttention(ValueError):
    """A backend cannot compute a layer as its `AttentionSpec` declares it; names both."""


# (q, k, q_weight, k_weight, cos, sin, positions, eps) -> (q, k): per-head RMSNorm, then rotate-half
# RoPE from cos/sin tables indexed by position (pegaserve.models.layers.qk_norm_rope is its reference)
QKNormRope = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class AttentionBackend(ABC):
    """One per model, shared by its layers; each layer passes its own `AttentionSpec` to every call
    after `check`ing it once. A backend holds no KV: the runner owns the cache and passes each
    layer's slice."""

    name: ClassVar[str]
    supports_logit_soft_cap: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False
    # A fused kernel for the per-head q/k RMSNorm + RoPE that some families run before attention,
    # where the backend brings one (`triton`); None: the family's own layers compute it.
    qk_norm_rope: ClassVar[QKNormRope | None] = None

    def check(self, spec: AttentionSpec) -> None:
        """Raise `UnsupportedAttention` if this backend cannot compute `spec` (the model, as it is built)."""
        if spec.logit_soft_cap is not None and not self.supports_logit_soft_cap:
            raise UnsupportedAttention(f"attention backend {self.name!r} does not support a logit soft-cap "
                                       f"({spec.logit_soft_cap})")
        if spec.sliding_window is not None and not self.supports_sliding_window:
            raise UnsupportedAttention(f"attention backend {self.name!r} does not support a sliding window "
                                       f"({spec.sliding_window} tokens)")

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        batch: AttentionBatch,
        spec: AttentionSpec,
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


MAX_BATCHED_QUERY = 16  # requests with at most this many queries share one padded SDPA call


class SdpaBackend(AttentionBackend):
    """torch scaled_dot_product_attention: one padded call for every request with few queries
    (decode tokens, speculative drafts, short chunks), one call per longer prefill chunk."""

    name = "sdpa"

    def forward(self, q, k, v, kv_layer, batch, spec):
        scale = spec.scale
        store_kv(k, v, kv_layer, batch.slot_mapping)
        if all(n <= MAX_BATCHED_QUERY for n in batch.query_lens):
            return self._batched(q, kv_layer, batch, scale, range(len(batch.query_lens)))
        out = torch.empty_like(q)
        short = [i for i, n in enumerate(batch.query_lens) if n <= MAX_BATCHED_QUERY]
        if short:
            rows = _query_rows(batch, short, q.device)
            out[rows] = self._batched(q, kv_layer, batch, scale, short)
        for i, n in enumerate(batch.query_lens):
            if n > MAX_BATCHED_QUERY:
                start = batch.query_starts[i]
                out[start : start + n] = self._chunk(q[start : start + n], k[start : start + n],
                                                     v[start : start + n], kv_layer, batch, i, scale)
        return out

    def _batched(self, q, kv_layer, batch, scale, requests) -> torch.Tensor:
        """Attention of requests with few queries each: `[their tokens, H, hd]`. On an AVX-512 or AVX2
        CPU the paged kernel reads the cache in place (`cpu_paged`); else one padded SDPA call."""
        requests = list(requests)
        everyone = len(requests) == len(batch.query_lens)
        found = cpu_paged.attend(
            q if everyone else q[_query_rows(batch, requests, q.device)], kv_layer,
            batch.block_tables if everyone else batch.block_tables[requests],
            [batch.context_lens_cpu[i] for i in requests], [batch.query_lens[i] for i in requests], scale)
        if found is not None:
            return found
        return self._padded(q, kv_layer, batch, scale, requests)

    def _padded(self, q, kv_layer, batch, scale, requests: list[int]) -> torch.Tensor:
        """`_batched` by torch's SDPA: every context gathered and padded to the longest, one call."""
        _, num_blocks, block_size, num_kv_heads, head_dim = kv_layer.shape
        query_lens = [batch.query_lens[i] for i in requests]
        max_query = max(query_lens)
        context_lens = batch.context_lens[requests] if len(requests) != len(batch.query_lens) else batch.context_lens
        max_blocks = -(-max(batch.context_lens_cpu[i] for i in requests) // block_size)
        tables = batch.block_tables[requests, :max_blocks] if len(requests) != len(batch.query_lens) \
            else batch.block_tables[:, :max_blocks]
        num_reqs = len(requests)
        # index_select over whole blocks copies 8 KB rows; advanced indexing is ~1.5x slower here
        blocks = kv_layer.view(2, num_blocks, -1).index_select(1, tables.reshape(-1))
        ctx = blocks.view(2, num_reqs, max_blocks * block_size, num_kv_heads, head_dim)
        ctx = ctx.transpose(2, 3)  # [2, B, kvh, L, hd]
        key_positions = torch.arange(ctx.shape[3], device=q.device)
        if max_query == 1:
            rows = q if num_reqs == q.shape[0] else q[_query_rows(batch, requests, q.device)]
            queries = rows[:, :, None, :]  # [B, H, 1, hd]
            mask = (key_positions[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
        else:
            queries = q.new_zeros(num_reqs, max_query, *q.shape[1:])  # [B, Q, H, hd], padded
            offsets = [j for n in query_lens for j in range(n)]
            owners = [b for b, n in enumerate(query_lens) for _ in range(n)]
            queries[owners, offsets] = q[_query_rows(batch, requests, q.device)]
            queries = queries.transpose(1, 2)  # [B, H, Q, hd]
            # query j of a request with n queries sits at position context_len - n + j
            lens = torch.tensor(query_lens, device=q.device)
            query_positions = context_lens[:, None] - lens[:, None] + torch.arange(max_query, device=q.device)
            mask = (key_positions[None, None, :] <= query_positions[:, :, None])[:, None]  # [B, 1, Q, L]
        out = F.scaled_dot_product_attention(queries, ctx[0], ctx[1], attn_mask=mask, scale=scale, enable_gqa=True)
        if max_query == 1:
            return out[:, :, 0, :]  # [B, H, hd]
        out = out.transpose(1, 2)  # [B, Q, H, hd]
        return out[owners, offsets]

    def _chunk(self, q, k, v, kv_layer, batch, i, scale) -> torch.Tensor:
        """One prefill chunk: a fresh prompt attends to its own K/V; a chunk continuing after a
        cached prefix attends over the gathered context, query j at position ctx_len - q_len + j."""
        q_len, ctx_len = batch.query_lens[i], batch.context_lens_cpu[i]
        if q_len == ctx_len:
            k_ctx, v_ctx, mask, causal = k, v, None, True
        else:
            num_blocks = -(-ctx_len // kv_layer.shape[2])
            k_ctx, v_ctx = gather_context(kv_layer, batch.block_tables[i, :num_blocks], ctx_len)
            rows = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= rows[:, None]
            causal = False
        # with a batch dimension (4-D) CPU SDPA takes its flash kernel; 3-D inputs take the math path
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, H, q_len, hd]
            k_ctx.transpose(0, 1)[None], v_ctx.transpose(0, 1)[None],
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
        )  # fmt: skip
        return o[0].transpose(0, 1)


def _query_rows(batch: AttentionBatch, requests, device) -> torch.Tensor:
    """The flattened step's rows of the given requests' queries, in order."""
    starts, lens = batch.query_starts, batch.query_lens
    return torch.tensor([starts[i] + j for i in requests for j in range(lens[i])], device=device)
