"""The model runner: turns a `SchedulerOutput` into tensors, runs the model, samples and scores.

It owns the KV cache tensor; the scheduler's block tables (carried in the message) say which of
its blocks each request uses. It reads nothing else of the scheduler's: every input it needs is
in the frozen `ScheduledRequest`s.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

from pegaserve.attention.backend import AttentionBatch
from pegaserve.sample.on_device import score_on_device
from pegaserve.sample.screened import sample_hidden
from pegaserve.sched.output import RunnerOutput, SchedulerOutput

SCORE_CHUNK_ROWS = 64  # prompt logprobs: LM-head rows at a time (never [prompt_len, vocab] at once)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, device: str = "cpu") -> None:
        cfg = model.config
        self.model = model
        # The model's screened head, where it has one, whatever the engine's role: a prefill's first
        # tokens come through it as a decode's next ones do (a seeded draw is the same on either, and
        # a first token without a logprob asked costs the screened head's read, ~2.5 ms against ~4
        # for the full logits at one row); built now (~0.7 s for the default model), not in a step.
        self._screened_head = getattr(model, "screened_head", None)
        if self._screened_head is not None:
            self._screened_head()
        self.block_size = block_size
        self.device = device
        shape = (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=cfg.dtype, device=device)  # [layers, 2, blocks, bs, kvh, hd]

    @torch.inference_mode()
    def run(self, output: SchedulerOutput) -> RunnerOutput:
        self._copy_blocks(output.block_copies)
        input_ids, positions, attn = self._prepare(output)
        hidden = self.model(input_ids, positions, self.kv_cache, attn)  # [num_tokens, hidden]
        return RunnerOutput(self._sample(hidden, output, attn), self._score(hidden, output, attn))

    def _prepare(self, output: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        requests = output.requests
        query_lens = [r.num_tokens for r in requests]
        context_lens = [r.start + r.num_tokens for r in requests]
        max_blocks = max(len(r.block_ids) for r in requests)
        tables = torch.tensor([[*r.block_ids, *[0] * (max_blocks - len(r.block_ids))] for r in requests],
                              dtype=torch.long)  # [num_reqs, max_blocks]
        input_ids = torch.tensor(list(itertools.chain.from_iterable(r.token_ids for r in requests)), dtype=torch.long)
        lens = torch.tensor(query_lens)
        owner = torch.repeat_interleave(torch.arange(len(requests)), lens)  # [num_tokens]: its request
        first = torch.cumsum(lens, 0) - lens  # each request's first row
        starts = torch.tensor([r.start for r in requests])
        positions = torch.arange(len(input_ids)) - first[owner] + starts[owner]
        slots = tables[owner, positions // self.block_size] * self.block_size + positions % self.block_size
        attn = AttentionBatch(
            slot_mapping=slots.to(self.device),
            block_tables=tables.to(self.device),
            context_lens=torch.tensor(context_lens, device=self.device),
            query_lens=tuple(query_lens),
            context_lens_cpu=tuple(context_lens),
        )
        return input_ids.to(self.device), positions.to(self.device), attn

    def _sample(self, hidden: torch.Tensor, output: SchedulerOutput, attn: AttentionBatch):
        """Tokens at every sampled position (its hidden state once, however many rows share it):
        through the model's screened head where the rows allow it and the model has one
        (sample/screened.py), else from the full logits."""
        flat: list[int] = []  # rows of `hidden` to put through the LM head
        row_of: list[int] = []  # per sampling row: its row of `picked`
        rows = []
        for r, start in zip(output.requests, attn.query_starts):
            for sample_at in r.samples:
                if not flat or flat[-1] != start + sample_at.offset:
                    flat.append(start + sample_at.offset)
                row_of.append(len(flat) - 1)
                rows.append(sample_at.row)
        if not rows:
            return tuple(() for _ in output.requests)
        picked = hidden.index_select(0, torch.tensor(flat, device=hidden.device))  # [num_positions, hidden]
        head = self._screened_head() if self._screened_head is not None else None
        tokens = iter(sample_hidden(picked, row_of, rows, head, lambda h: self.model.compute_logits(h).float()))
        return tuple(tuple(itertools.islice(tokens, len(r.samples))) for r in output.requests)

    def _score(self, hidden: torch.Tensor, output: SchedulerOutput, attn: AttentionBatch):
        """Prompt logprobs, a bounded number of LM-head rows at a time."""
        scores = []
        for r, start in zip(output.requests, attn.query_starts):
            found = []
            first = start + r.score_from
            for i in range(0, len(r.score_targets), SCORE_CHUNK_ROWS):
                chunk = hidden[first + i : first + min(i + SCORE_CHUNK_ROWS, len(r.score_targets))]
                logits = self.model.compute_logits(chunk).float()
                found += score_on_device(logits, r.score_targets[i : i + SCORE_CHUNK_ROWS], r.num_top_scores)
            scores.append(tuple(found))
        return tuple(scores)

    def _copy_blocks(self, copies: tuple[tuple[int, int], ...]) -> None:
        """Copy-on-write: a shared block's content into the private copy a request will write into."""
        if copies:
            sources = torch.tensor([s for s, _ in copies], device=self.device)
            destinations = torch.tensor([d for _, d in copies], device=self.device)
            self.kv_cache.index_copy_(2, destinations, self.kv_cache.index_select(2, sources))

    def export_blocks(self, block_ids) -> torch.Tensor:
        """Pack blocks for the handoff: `[num_layers, 2, len(block_ids), block_size, kvh, hd]`."""
        return pack_blocks(self.kv_cache, block_ids)

    def import_blocks(self, block_ids, packed: torch.Tensor) -> None:
        unpack_blocks(self.kv_cache, block_ids, packed)


def pack_blocks(kv_cache: torch.Tensor, block_ids) -> torch.Tensor:
    """`kv_cache[:, :, block_ids]`, contiguous: the handoff's packed form. On CUDA the Triton
    gather kernel (pegaserve.kernels/block_copy.py) does it; elsewhere torch's index_select."""
    index = torch.tensor(list(block_ids), device=kv_cache.device)
    if kv_cache.is_cuda and _block_copy() is not None:
        return _block_copy().gather_blocks(kv_cache, index)
    return kv_cache.index_select(2, index)


def unpack_blocks(kv_cache: torch.Tensor, block_ids, packed: torch.Tensor) -> None:
    """`kv_cache[:, :, block_ids] = packed` (the Triton scatter kernel on CUDA)."""
    expected = (*kv_cache.shape[:2], len(block_ids), *kv_cache.shape[3:])
    if tuple(packed.shape) != expected:
        raise ValueError(f"KV shape {tuple(packed.shape)} does not fit this cache: expected {expected}")
    index = torch.tensor(list(block_ids), device=kv_cache.device)
    packed = packed.to(kv_cache)
    if kv_cache.is_cuda and _block_copy() is not None:
        _block_copy().scatter_blocks(packed, kv_cache, index)
    else:
        kv_cache.index_copy_(2, index, packed)


def pack_layer(kv_cache: torch.Tensor, layer: int, index: torch.Tensor, out: torch.Tensor) -> None:
    """`out = kv_cache[layer][:, index]` (`[2, n, block_size, kvh, hd]`): one layer of the handoff's
    packed form, so that a layer can travel while the next is packed."""
    if kv_cache.is_cuda and _block_copy() is not None:
        _block_copy().gather_blocks(kv_cache[layer : layer + 1], index, out=out[None])
    else:
        torch.index_select(kv_cache[layer], 1, index, out=out)


def unpack_layer(kv_cache: torch.Tensor, layer: int, index: torch.Tensor, part: torch.Tensor) -> None:
    """`kv_cache[layer][:, index] = part` (`pack_layer`'s other half)."""
    if kv_cache.is_cuda and _block_copy() is not None:
        _block_copy().scatter_blocks(part[None], kv_cache[layer : layer + 1], index)
    else:
        kv_cache[layer].index_copy_(1, index, part)


def copy_blocks(source: torch.Tensor, source_ids: list[int], target: torch.Tensor, target_ids: list[int]) -> None:
    """`target[:, :, target_ids] = source[:, :, source_ids]` between two caches of one layout (the
    same-node handoff: prefill's cache, mapped, into decode's). Blocks that sit in a run in both caches
    move as one strided copy: a fresh prompt's blocks usually do, and then 8 MB copy in ~0.7 ms
    where a gather and a scatter take ~3.5."""
    slabs = source.shape[0] * source.shape[1]
    flat_source = source.view(slabs, source.shape[2], -1)  # [layers * 2, num_blocks, block elements]
    flat_target = target.view(slabs, target.shape[2], -1)
    for first_source, first_target, width in block_runs(source_ids, target_ids):
        flat_target[:, first_target : first_target + width].copy_(flat_source[:, first_source : first_source + width])


Run = tuple[int, int, int]  # (lowest source block id, lowest target block id, number of blocks)


def block_runs(source_ids: list[int], target_ids: list[int]) -> Iterator[Run]:
    """The stretches where both id lists step by the same +1 or -1, as (lowest source id, lowest
    target id, length): ascending slices of both caches that hold the same blocks in the same order."""
    assert len(source_ids) == len(target_ids), (len(source_ids), len(target_ids))
    start, n = 0, len(source_ids)
    if n and _ascending(source_ids) and _ascending(target_ids):  # the usual case, at C speed
        yield source_ids[0], target_ids[0], n
        return
    while start < n:
        end, step = start + 1, None
        while end < n:
            moved = source_ids[end] - source_ids[end - 1]
            if moved not in (1, -1) or moved != target_ids[end] - target_ids[end - 1] or step not in (None, moved):
                break
            step, end = moved, end + 1
        last = end - 1
        yield min(source_ids[start], source_ids[last]), min(target_ids[start], target_ids[last]), end - start
        start = end


def _ascending(ids: list[int]) -> bool:
    """Whether `ids` are consecutive, rising by 1."""
    return ids == list(range(ids[0], ids[0] + len(ids)))


def _block_copy():
    try:
        from pegaserve.kernels import block_copy  # noqa: PLC0415 - the optional GPU path
    except ImportError:
        return None
    return block_copy
