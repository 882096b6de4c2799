"""The engine's `triton` attention backend: store K/V, then paged decode or prefill attention.

Chosen by `make_backend("triton")`, and by `"auto"` on CUDA. On the CPU it runs only under
Triton's interpreter (`TRITON_INTERPRET=1`), which is how its parity with `sdpa` is tested.
"""

from __future__ import annotations

import torch

from pegaserve.attention.backend import AttentionBackend, AttentionBatch
from pegaserve.kernels.decode_attention import paged_decode_attention
from pegaserve.kernels.norm_rope import qk_norm_rope
from pegaserve.kernels.prefill_attention import prefill_attention
from pegaserve.kernels.store_kv import store_kv


class TritonBackend(AttentionBackend):
    """Decode steps (one query per request) use the split-K decode kernel; any other step uses the
    varlen prefill kernel, which also serves prompts continuing after a cached prefix.

    Owns one memo: the last step's `query_start_loc`, built once per `AttentionBatch` (the model
    calls `forward` once per layer with the same batch object) instead of once per layer.
    """

    name = "triton"

    def __init__(self) -> None:
        self._memo: tuple[AttentionBatch, torch.Tensor] | None = None

    def qk_norm_rope(self, q, k, q_norm, k_norm, rotary, positions):
        """The fused kernel (pegaserve.kernels/norm_rope.py): one launch for both norms and both rotations."""
        assert q_norm.eps == k_norm.eps
        return qk_norm_rope(q, k, q_norm.weight, k_norm.weight, rotary.cos, rotary.sin, positions, q_norm.eps)

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        batch: AttentionBatch,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
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
