"""The CPU paged attention kernel (`pegaserve/cpu/csrc/paged_attention.cpp`) against its reference,
torch's SDPA over the gathered, padded contexts (`SdpaBackend._padded`): decode queries, several
queries per request (speculative drafts, short chunks), GQA, head sizes, contexts on and off block
edges, scattered block tables, and a step that mixes them with a long prefill chunk."""

import pytest
import torch

from pegaserve.attention import cpu_paged
from pegaserve.attention.backend import AttentionBatch, AttentionSpec, SdpaBackend
from tests.helpers import kernel_marks

pytestmark = kernel_marks("SDPA is used")


def make_batch(context_lens: list[int], query_lens: list[int], block_size: int, num_blocks: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-c // block_size) for c in context_lens)
    free = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.long)
    for i, c in enumerate(context_lens):
        for b in range(-(-c // block_size)):
            tables[i, b] = free.pop()
    return AttentionBatch(slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long), block_tables=tables,
                          context_lens=torch.tensor(context_lens), query_lens=tuple(query_lens),
                          context_lens_cpu=tuple(context_lens))


def test_the_kernel_builds_and_loads():
    assert cpu_paged._library() is not None  # else every comparison below is SDPA against SDPA


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (8, 8, 32), (16, 2, 128), (2, 1, 16)])
@pytest.mark.parametrize("query_lens", [[1] * 7, [1, 5, 3, 1, 16, 2, 4]], ids=["decode", "several"])
def test_the_kernel_equals_sdpa(num_heads, num_kv_heads, head_dim, query_lens):
    block_size, num_blocks = 16, 96
    context_lens = [q + c for q, c in zip(query_lens, [0, 15, 16, 17, 100, 250, 31])]
    batch = make_batch(context_lens, query_lens, block_size, num_blocks, seed=head_dim)
    generator = torch.Generator().manual_seed(1)
    kv_layer = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    backend, everyone = SdpaBackend(), list(range(len(query_lens)))
    found = backend._batched(q, kv_layer, batch, head_dim**-0.5, everyone)
    torch.testing.assert_close(found, backend._padded(q, kv_layer, batch, head_dim**-0.5, everyone),
                               rtol=1e-5, atol=1e-5)


def test_a_step_mixing_decodes_and_a_prefill_chunk_equals_sdpa(monkeypatch):
    query_lens, context_lens = [1, 40, 3], [20, 40, 70]
    batch = make_batch(context_lens, query_lens, 16, 32, seed=5)
    generator = torch.Generator().manual_seed(2)
    kv_layer = torch.randn(2, 32, 16, 2, 64, generator=generator)
    q, k, v = (torch.randn(44, h, 64, generator=generator) for h in (4, 2, 2))
    backend, spec = SdpaBackend(), AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125)
    found = backend.forward(q, k, v, kv_layer.clone(), batch, spec)
    monkeypatch.setattr(cpu_paged, "_library", lambda: None)
    torch.testing.assert_close(found, backend.forward(q, k, v, kv_layer.clone(), batch, spec), rtol=1e-5, atol=1e-5)


def test_unsupported_inputs_fall_back():
    kv_layer = torch.randn(2, 4, 16, 1, 8)  # head_dim 8: not a multiple of 16
    assert cpu_paged.attend(torch.randn(1, 2, 8), kv_layer, torch.zeros(1, 1, dtype=torch.long), [3], [1], 1.0) \
        is None
    kv_layer = torch.randn(2, 4, 16, 1, 16, dtype=torch.float64)
    assert cpu_paged.attend(torch.randn(1, 2, 16, dtype=torch.float64), kv_layer,
                                torch.zeros(1, 1, dtype=torch.long), [3], [1], 1.0) is None
