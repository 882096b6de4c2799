"""KV cache kernels against their torch references: store by slot mapping, and the handoff's
gather (pack) / scatter (unpack) of whole blocks across all layers."""

import pytest
import torch

from pegaserve.kernels.testing import kernel_devices, kernel_dtypes, kernels_unavailable_reason

if (reason := kernels_unavailable_reason()) is not None:
    pytest.skip(reason, allow_module_level=True)

from pegaserve.kernels.block_copy import (  # noqa: E402
    gather_blocks,
    gather_blocks_reference,
    scatter_blocks,
    scatter_blocks_reference,
)
from pegaserve.kernels.store_kv import store_kv, store_kv_reference  # noqa: E402
from pegaserve.kernels.testing import make_paged_batch, noise, random_qkv  # noqa: E402

DEVICE_DTYPES = [(d, t) for d in kernel_devices() for t in kernel_dtypes(d)]


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(1, 16), (2, 32), (4, 40)])
def test_store_kv_matches_reference(device, dtype, block_size, num_kv_heads, head_dim):
    # a prompt continuing after a cached prefix, a fresh prompt and a decode token, in scattered blocks
    batch = make_paged_batch(
        [21, 9, 30], [5, 9, 1], block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
        dtype=dtype, device=device,
    )  # fmt: skip
    _, k, v = random_qkv(sum(batch.query_lens), 1, num_kv_heads, head_dim, dtype, device)
    got, expected = batch.kv_layer.clone(), batch.kv_layer.clone()
    store_kv(k, v, got, batch.slot_mapping)
    store_kv_reference(k, v, expected, batch.slot_mapping)
    assert torch.equal(got, expected)  # a copy: bit-exact, and every other slot untouched


@pytest.mark.parametrize("device", kernel_devices())
def test_store_kv_reads_strided_token_rows(device):
    """k and v as views into one fused [T, 2 * kvh, hd] projection: token stride != kvh * hd."""
    batch = make_paged_batch([12], [12], block_size=8, num_kv_heads=2, head_dim=16, device=device)
    kv = noise((12, 4, 16), torch.float32, device, seed=5)  # [T, 2 * kvh, hd]
    k, v = kv[:, :2], kv[:, 2:]
    got, expected = batch.kv_layer.clone(), batch.kv_layer.clone()
    store_kv(k, v, got, batch.slot_mapping)
    store_kv_reference(k, v, expected, batch.slot_mapping)
    assert torch.equal(got, expected)


def _whole_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device, seed):
    shape = (3, 2, num_blocks, block_size, num_kv_heads, head_dim)  # [layers, K/V, blocks, ...]
    return noise(shape, dtype, device, seed)


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(8, 2, 16), (16, 1, 40), (16, 4, 64)])
def test_gather_then_scatter_moves_blocks_between_caches(device, dtype, block_size, num_kv_heads, head_dim):
    """Prefill side packs blocks 7, 2, 5 (out of order, with holes); decode side unpacks them into
    its own blocks 1, 9, 4. Every other block of the receiver stays as it was."""
    sender = _whole_cache(10, block_size, num_kv_heads, head_dim, dtype, device, seed=0)
    src_ids = torch.tensor([7, 2, 5], device=device)
    packed = gather_blocks(sender, src_ids)
    assert packed.is_contiguous()
    assert torch.equal(packed, gather_blocks_reference(sender, src_ids))

    receiver = _whole_cache(12, block_size, num_kv_heads, head_dim, dtype, device, seed=1)
    expected = receiver.clone()
    dst_ids = torch.tensor([1, 9, 4], device=device)
    scatter_blocks(packed, receiver, dst_ids)
    scatter_blocks_reference(packed, expected, dst_ids)
    assert torch.equal(receiver, expected)


@pytest.mark.parametrize("device", kernel_devices())
def test_block_copy_of_no_blocks_is_a_no_op(device):
    cache = _whole_cache(4, 8, 1, 16, torch.float32, device, seed=0)
    before = cache.clone()
    empty = torch.empty(0, dtype=torch.int64, device=device)
    packed = gather_blocks(cache, empty)
    assert packed.shape == (3, 2, 0, 8, 1, 16)
    scatter_blocks(packed, cache, empty)
    assert torch.equal(cache, before)


@pytest.mark.parametrize("device", kernel_devices())
def test_block_copy_honors_layer_strides(device):
    """Every other layer of the cache (a strided view): only each block must be dense."""
    cache = _whole_cache(6, 8, 2, 16, torch.float32, device, seed=0)
    ids = torch.tensor([5, 0, 3], device=device)
    layers = cache[::2]  # [2, 2, 6, 8, 2, 16], layer stride twice the dense one
    packed = gather_blocks(layers, ids)
    assert torch.equal(packed, gather_blocks_reference(layers, ids))
    scatter_blocks(packed.flip(2).contiguous(), layers, ids)
    assert torch.equal(cache[::2][:, :, ids], packed.flip(2))
    assert torch.equal(cache[1], _whole_cache(6, 8, 2, 16, torch.float32, device, seed=0)[1])
