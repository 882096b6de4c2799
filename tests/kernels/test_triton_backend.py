"""The `triton` attention backend equals `sdpa`: per call on random paged batches, and as greedy
tokens of the whole engine on the tiny model (interpreted on CPU, compiled on CUDA)."""

import pytest
import torch

from pegaserve.kernels.testing import kernel_devices, kernels_unavailable_reason

if (reason := kernels_unavailable_reason()) is not None:
    pytest.skip(reason, allow_module_level=True)

from pegaserve.attention.backend import AttentionBatch, AttentionSpec, SdpaBackend  # noqa: E402
from pegaserve.attention.registry import backend_class, make_backend  # noqa: E402
from pegaserve.attention.triton import TritonBackend  # noqa: E402
from pegaserve.config import EngineConfig  # noqa: E402
from pegaserve.engine.build import load_engine  # noqa: E402
from pegaserve.kernels.testing import make_paged_batch, random_qkv  # noqa: E402
from tests.helpers import PROMPTS, greedy_request, run_to_completion, token_ids  # noqa: E402

NEW_TOKENS = 4


def test_make_backend_selects_triton():
    assert backend_class("triton") is TritonBackend
    assert isinstance(make_backend("triton"), TritonBackend)
    assert make_backend("triton").name == "triton"


def test_auto_picks_triton_on_cuda_else_sdpa():
    assert type(make_backend("auto")) is (TritonBackend if torch.cuda.is_available() else SdpaBackend)


@pytest.mark.parametrize("device", kernel_devices())
@pytest.mark.parametrize(
    "query_lens,context_lens",
    [([1, 1, 1], [1, 17, 30]), ([6, 11], [6, 11]), ([4, 9, 1], [20, 9, 13])],
    ids=["decode", "prefill", "continue-after-prefix"],
)
def test_backend_forward_equals_sdpa(device, query_lens, context_lens):
    paged = make_paged_batch(context_lens, query_lens, block_size=8, num_kv_heads=2, head_dim=32, device=device)
    batch = AttentionBatch(
        slot_mapping=paged.slot_mapping,
        block_tables=paged.block_tables,
        context_lens=paged.context_lens,
        query_lens=paged.query_lens,
        context_lens_cpu=paged.context_lens_cpu,
    )
    q, k, v = random_qkv(sum(query_lens), 4, 2, 32, torch.float32, device)
    cache_triton, cache_sdpa = paged.kv_layer.clone(), paged.kv_layer.clone()
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=32, scale=0.17)
    out = TritonBackend().forward(q, k, v, cache_triton, batch, spec)
    expected = SdpaBackend().forward(q, k, v, cache_sdpa, batch, spec)
    assert torch.equal(cache_triton, cache_sdpa)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", kernel_devices())
def test_engine_greedy_tokens_equal_sdpa(tiny_model_dir, device):
    """Prefill (prompts spanning several blocks of 8) then decode steps: identical greedy tokens."""
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]
    tokens = {}
    for backend in ("sdpa", "triton"):
        engine = load_engine(
            tiny_model_dir, EngineConfig(num_blocks=32, block_size=8), attention_backend=backend,
            device=device, dtype=torch.float32,
        )  # fmt: skip
        for i, prompt in enumerate(prompts):
            engine.add_request(greedy_request(f"r{i}", prompt, NEW_TOKENS))
        outputs = run_to_completion(engine)
        tokens[backend] = [token_ids(outputs[f"r{i}"]) for i in range(len(prompts))]
    assert tokens["triton"] == tokens["sdpa"]
    assert all(len(t) == NEW_TOKENS for t in tokens["triton"])
