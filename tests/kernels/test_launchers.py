"""Each launcher rejects bad inputs with a ValueError naming the argument, before any launch."""

import pytest
import torch

from pegaserve.kernels.testing import kernel_devices, kernels_unavailable_reason

if (reason := kernels_unavailable_reason()) is not None:
    pytest.skip(reason, allow_module_level=True)

from pegaserve.kernels.block_copy import gather_blocks, scatter_blocks  # noqa: E402
from pegaserve.kernels.decode_attention import paged_decode_attention  # noqa: E402
from pegaserve.kernels.prefill_attention import prefill_attention  # noqa: E402
from pegaserve.kernels.store_kv import store_kv  # noqa: E402

DEVICE = kernel_devices()[0]
BS, KVH, HD = 8, 2, 16


def _kv_layer(dtype=torch.float32):
    return torch.zeros((2, 4, BS, KVH, HD), dtype=dtype, device=DEVICE)  # [2, blocks, bs, kvh, hd]


def _t(*shape, dtype=torch.float32):
    return torch.zeros(shape, dtype=dtype, device=DEVICE)


def _i(*values):
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


STORE_CASES = {
    "k": dict(k=_t(3, KVH, HD + 1)),
    "v": dict(v=_t(3, KVH, HD, dtype=torch.float16)),
    "slot_mapping": dict(slot_mapping=_t(3)),
    "kv_layer": dict(kv_layer=_t(3, 4, BS, KVH, HD)),
}


@pytest.mark.parametrize("bad", list(STORE_CASES))
def test_store_kv_names_the_bad_argument(bad):
    args = dict(k=_t(3, KVH, HD), v=_t(3, KVH, HD), kv_layer=_kv_layer(), slot_mapping=_i(0, 1, 2))
    args.update(STORE_CASES[bad])
    with pytest.raises(ValueError, match=rf"^{bad}:"):
        store_kv(**args)


def test_store_kv_rejects_a_token_count_mismatch():
    with pytest.raises(ValueError, match=r"^v: expected shape \[3, 2, 16\]"):
        store_kv(_t(3, KVH, HD), _t(2, KVH, HD), _kv_layer(), _i(0, 1, 2))


DECODE_CASES = {
    "q": dict(q=_t(2, 3, HD)),  # 3 heads over 2 kv heads
    "block_tables": dict(block_tables=_i(1, 2)),
    "context_lens": dict(context_lens=_t(2)),
    "max_context_len": dict(max_context_len=0),
    "num_splits": dict(num_splits=0),
    "block_n": dict(block_n=24),
    "out": dict(out=_t(2, 4, HD, dtype=torch.float16)),
}


@pytest.mark.parametrize("bad", list(DECODE_CASES))
def test_decode_names_the_bad_argument(bad):
    args = dict(
        q=_t(2, 4, HD), kv_layer=_kv_layer(), block_tables=_i(1, 2).view(2, 1), context_lens=_i(3, 5),
        scale=0.25, max_context_len=5,
    )  # fmt: skip
    args.update(DECODE_CASES[bad])
    with pytest.raises(ValueError, match=rf"^{bad}:"):
        paged_decode_attention(**args)


def test_decode_rejects_q_in_another_dtype_than_the_cache():
    with pytest.raises(ValueError, match=r"^q: dtype torch.float16 differs"):
        paged_decode_attention(
            _t(2, 4, HD, dtype=torch.float16), _kv_layer(), _i(1, 2).view(2, 1), _i(3, 5), 0.25, max_context_len=5
        )


PREFILL_CASES = {
    "q": dict(q=_t(4, 4, HD, dtype=torch.int32)),
    "query_start_loc": dict(query_start_loc=_i(0, 4)),
    "max_query_len": dict(max_query_len=-1),
    "kv_layer": dict(kv_layer=_kv_layer().transpose(-1, -2)),
}


@pytest.mark.parametrize("bad", list(PREFILL_CASES))
def test_prefill_names_the_bad_argument(bad):
    args = dict(
        q=_t(4, 4, HD), kv_layer=_kv_layer(), block_tables=_i(1, 2).view(2, 1), context_lens=_i(3, 5),
        query_start_loc=_i(0, 3, 4), scale=0.25, max_query_len=3,
    )  # fmt: skip
    args.update(PREFILL_CASES[bad])
    with pytest.raises(ValueError, match=rf"^{bad}:"):
        prefill_attention(**args)


def test_block_copy_names_the_bad_argument():
    cache = _t(2, 2, 4, BS, KVH, HD)
    with pytest.raises(ValueError, match=r"^block_ids:"):
        gather_blocks(cache, _t(2))
    with pytest.raises(ValueError, match=r"^out:"):
        gather_blocks(cache, _i(1, 2), out=_t(2, 2, 3, BS, KVH, HD))
    with pytest.raises(ValueError, match=r"^packed: dtype"):
        scatter_blocks(_t(2, 2, 2, BS, KVH, HD, dtype=torch.float16), cache, _i(1, 2))
    with pytest.raises(ValueError, match=r"^kv_cache: each block must be contiguous"):
        gather_blocks(cache.transpose(3, 4), _i(1, 2))


@pytest.mark.skipif(DEVICE != "cpu", reason="the interpreter switch only matters for CPU tensors")
def test_cpu_tensors_need_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"^kv_layer: a CPU tensor needs TRITON_INTERPRET=1"):
        store_kv(_t(3, KVH, HD), _t(3, KVH, HD), _kv_layer(), _i(0, 1, 2))
