"""Paged decode and prefill attention kernels against their torch references.

On CPU the kernels run in Triton's interpreter (fp32, tiny shapes); with CUDA the same cases run
compiled, in fp32/fp16/bf16, plus a few serving-sized ones.
"""

import pytest
import torch

from pegaserve.kernels.testing import kernel_devices, kernel_dtypes, kernels_unavailable_reason

if (reason := kernels_unavailable_reason()) is not None:
    pytest.skip(reason, allow_module_level=True)

from pegaserve.kernels.decode_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_reference,
    plan_splits,
)
from pegaserve.kernels.prefill_attention import prefill_attention, prefill_attention_reference  # noqa: E402
from pegaserve.kernels.testing import make_paged_batch, random_qkv, tolerance  # noqa: E402

DEVICE_DTYPES = [(d, t) for d in kernel_devices() for t in kernel_dtypes(d)]
# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 2, 4, and a head_dim that is not a power of 2
HEADS = [(2, 2, 32), (4, 2, 32), (4, 1, 16), (8, 2, 40)]
GPU_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="serving-sized shapes need CUDA")


def _run_decode(device, dtype, block_size, heads, context_lens, num_splits=None, block_n=None):
    num_heads, num_kv_heads, head_dim = heads
    batch = make_paged_batch(
        context_lens, [1] * len(context_lens), block_size=block_size, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype, device=device,
    )  # fmt: skip
    q, _, _ = random_qkv(len(context_lens), num_heads, num_kv_heads, head_dim, dtype, device)
    scale = head_dim**-0.5
    out = paged_decode_attention(
        q, batch.kv_layer, batch.block_tables, batch.context_lens, scale,
        max_context_len=max(context_lens), num_splits=num_splits, block_n=block_n,
    )  # fmt: skip
    expected = paged_decode_attention_reference(q, batch.kv_layer, batch.block_tables, batch.context_lens, scale)
    torch.testing.assert_close(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads", HEADS)
def test_decode_matches_reference(device, dtype, block_size, heads):
    _run_decode(device, dtype, block_size, heads, context_lens=[1, 9, 30, 17])


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_splits", [2, 3])
def test_decode_split_k_merges_exactly(device, dtype, num_splits):
    # the longest context has 3 tiles of 16: splits of 2 tiles leave the short requests with empty splits
    _run_decode(device, dtype, 8, (4, 2, 32), context_lens=[40, 3, 16, 33], num_splits=num_splits, block_n=16)


def test_plan_splits_covers_the_longest_context_with_whole_tiles():
    for max_len in (1, 15, 16, 17, 2048, 5000):
        num_splits, split_len = plan_splits(64, 8, max_len, block_n=64, target_programs=528)
        assert split_len % 64 == 0 and (num_splits - 1) * split_len < max_len <= num_splits * split_len
    assert plan_splits(64, 8, 2048, 64, target_programs=528)[0] == 2
    assert plan_splits(1, 8, 2048, 64, target_programs=528)[0] == 32


def _run_prefill(device, dtype, block_size, heads, query_lens, context_lens):
    num_heads, num_kv_heads, head_dim = heads
    batch = make_paged_batch(
        context_lens, query_lens, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=dtype, device=device,
    )  # fmt: skip
    q, _, _ = random_qkv(sum(query_lens), num_heads, num_kv_heads, head_dim, dtype, device)
    scale = head_dim**-0.5
    args = (q, batch.kv_layer, batch.block_tables, batch.context_lens, batch.query_start_loc, scale)
    out = prefill_attention(*args, max_query_len=max(query_lens))
    torch.testing.assert_close(out, prefill_attention_reference(*args), **tolerance(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("heads", HEADS)
def test_prefill_fresh_prompts_match_reference(device, dtype, block_size, heads):
    lens = [7, 1, 20]
    _run_prefill(device, dtype, block_size, heads, query_lens=lens, context_lens=lens)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
def test_prefill_continues_after_a_cached_prefix(device, dtype, block_size):
    # queries sit at the end of their context: 16 cached + 5 new, a fresh prompt, 23 cached + 17 new
    _run_prefill(device, dtype, block_size, (4, 2, 32), query_lens=[5, 3, 17], context_lens=[21, 3, 40])


@GPU_ONLY
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_serving_sized_decode_on_gpu(dtype):
    context_lens = [2048, 1, 700, 1500, 33, 2047, 64, 1000]
    _run_decode("cuda", dtype, 16, (16, 8, 128), context_lens)


@GPU_ONLY
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_serving_sized_prefill_on_gpu(dtype):
    _run_prefill("cuda", dtype, 16, (16, 8, 128), query_lens=[300, 1, 129, 64], context_lens=[300, 500, 129, 64])
