"""The engine's `triton` attention backend: store K/V, then paged decode or prefill attention.

Registered as `triton` (pegaserve.attention.registry, imported only when chosen: it needs triton),
and what `auto` picks on CUDA. On the CPU it runs only under Triton's interpreter
(`TRITON_INTERPRET=1`), which is how its parity with `sdpa` is tested.
"""

from __future__ import annotations

import torch

from pegaserve.attention.backend import AttentionBackend, AttentionBatch, AttentionSpec
from pegaserve.kernels import norm_rope
from pegaserve.kernels.decode_attention import paged_decode_attention
from pegaserve.kernels.prefill_attention import prefill_attention
from pegaserve.kernels.store_kv import store_kv


class TritonBackend(AttentionBackend):
    """Decode steps (one query per request) use the split-K decode kernel; any other step uses the
    varlen prefill kernel, which also serves prompts continuing after a cached prefix.

    Owns one memo: the last step's `query_start_loc`, built once per `AttentionBatch` (the model
    calls `forward` once per layer with the same batch object) instead of once per layer.
    """

    name = "triton"
    # one launch for both per-head norms and both rotations (pegaserve.kernels/norm_rope.py)
    qk_norm_rope = staticmethod(norm_rope.qk_norm_rope)

    def __init__(self) -> None:
        self._memo: tuple[AttentionBatch, torch.Tensor] | None = None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        batch: AttentionBatch,
        spec: AttentionSpec,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        scale = spec.scale
        store_kv(k, v, kv_layer, batch.slot_mapping)
        if batch.is_decode:
            return paged_decode_attention(
                q, kv_layer, batch.block_tables, batch.context_lens, scale, max_context_len=max(batch.context_lens_cpu)
            )
        return prefill_attention(
            q,
            kv_layer,
            batch.block_tables,
            batch.context_lens,
            self._query_start_loc(batch),
            scale,
            max_query_len=max(batch.query_lens),
        )

    def _query_start_loc(self, batch: AttentionBatch) -> torch.Tensor:
        """`[num_reqs + 1]` cumulative query lengths, on the batch's device."""
        if self._memo is None or self._memo[0] is not batch:
            starts = torch.tensor((0, *batch.query_lens), dtype=torch.int64).cumsum(0)
            self._memo = (batch, starts.to(batch.slot_mapping.device))
        return self._memo[1]
