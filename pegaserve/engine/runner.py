"""The model runner: turns a scheduled batch into tensors, runs the model, samples.

It owns the KV cache tensor; requests' block tables say which of its blocks they use.
"""

from __future__ import annotations

import torch

from pegaserve.engine.attention import AttentionBatch
from pegaserve.engine.request import Request, SampledToken
from pegaserve.engine.sampler import SamplingRow, sample
from pegaserve.engine.scheduler import ScheduledBatch


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: str = "cpu") -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=cfg.dtype, device=device)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> list[SampledToken]:
        input_ids, positions, attn = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, attn)  # [num_tokens, hidden]
        if not attn.is_decode:  # only each request's last token is sampled
            hidden = hidden[torch.tensor(attn.query_lens, device=self.device).cumsum(0) - 1]
        logits = self.model.compute_logits(hidden)  # [num_reqs, vocab]
        return sample(logits.cpu(), [_sampling_row(r) for r in batch.requests])

    def _prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_size = self.block_size
        for request in batch.requests:
            start = request.num_computed_tokens if batch.is_prefill else request.num_tokens - 1
            end = request.num_tokens
            token_ids += _token_ids(request, start, end)
            positions += range(start, end)
            block_ids = request.block_ids
            slots += (block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
            query_lens.append(end - start)
            context_lens.append(end)
        max_blocks = max(len(r.block_ids) for r in batch.requests)
        tables = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r in batch.requests]
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=self.device)  # noqa: E731
        attn = AttentionBatch(
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(tables),
            context_lens=as_tensor(context_lens),
            query_lens=tuple(query_lens),
            context_lens_cpu=tuple(context_lens),
        )
        return as_tensor(token_ids), as_tensor(positions), attn

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Pack blocks for the handoff: `[num_layers, 2, len(block_ids), block_size, kvh, hd]`."""
        return self.kv_cache[:, :, torch.tensor(block_ids, device=self.device)].contiguous()

    def import_blocks(self, block_ids: list[int], packed: torch.Tensor) -> None:
        expected = (*self.kv_cache.shape[:2], len(block_ids), *self.kv_cache.shape[3:])
        if tuple(packed.shape) != expected:
            raise ValueError(f"KV shape {tuple(packed.shape)} does not fit this cache: expected {expected}")
        self.kv_cache[:, :, torch.tensor(block_ids, device=self.device)] = packed.to(self.kv_cache)


def _token_ids(request: Request, start: int, end: int) -> list[int]:
    """`request.all_token_ids()[start:end]` without copying the whole sequence (a decode step
    needs only the last token)."""
    prompt = request.spec.prompt_token_ids
    if start >= len(prompt):
        return [t.token_id for t in request.output[start - len(prompt) : end - len(prompt)]]
    return request.all_token_ids()[start:end]


def _sampling_row(request: Request) -> SamplingRow:
    num_output = request.num_output_tokens
    return SamplingRow(request.spec.sampling, num_output, request.spec.policy.masked_token_ids(num_output))
