"""Fused RMSNorm kernels against their references, and the references against the model's own
`RMSNorm`/`Rotary` modules (the references are specs of what the model computes)."""

import pytest
import torch

from pegaserve.kernels.testing import kernel_devices, kernel_dtypes, kernels_unavailable_reason

if (reason := kernels_unavailable_reason()) is not None:
    pytest.skip(reason, allow_module_level=True)

from pegaserve.kernels.norm_rope import (  # noqa: E402
    add_rms_norm,
    add_rms_norm_reference,
    qk_norm_rope,
    qk_norm_rope_reference,
)
from pegaserve.kernels.testing import noise, tolerance  # noqa: E402
from pegaserve.models.layers import RMSNorm, Rotary  # noqa: E402

DEVICE_DTYPES = [(d, t) for d in kernel_devices() for t in kernel_dtypes(d)]
EPS = 1e-6


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("hidden", [64, 48])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_reference(device, dtype, hidden, with_residual):
    x = noise((5, hidden), dtype, device, seed=0)
    residual = noise((5, hidden), dtype, device, seed=1) if with_residual else None
    weight = 1 + 0.1 * noise((hidden,), dtype, device, seed=2)
    out, summed = add_rms_norm(x, weight, EPS, residual)
    expected_out, expected_summed = add_rms_norm_reference(x, weight, EPS, residual)
    torch.testing.assert_close(summed, expected_summed, atol=0, rtol=0)
    torch.testing.assert_close(out, expected_out, **tolerance(dtype))


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 2, 32), (2, 1, 64), (6, 3, 16)])
def test_qk_norm_rope_matches_reference(device, dtype, num_heads, num_kv_heads, head_dim):
    rotary = Rotary(head_dim, theta=1e6, max_positions=64).to(device)
    q = noise((7, num_heads, head_dim), dtype, device, seed=0)
    k = noise((7, num_kv_heads, head_dim), dtype, device, seed=1)
    q_weight = 1 + 0.1 * noise((head_dim,), dtype, device, seed=2)
    k_weight = 1 + 0.1 * noise((head_dim,), dtype, device, seed=3)
    positions = torch.tensor([0, 1, 2, 40, 41, 63, 5], device=device)
    args = (q, k, q_weight, k_weight, rotary.cos, rotary.sin, positions, EPS)
    for got, expected in zip(qk_norm_rope(*args), qk_norm_rope_reference(*args)):
        assert got.is_contiguous()
        torch.testing.assert_close(got, expected, **tolerance(dtype))


def test_references_are_the_models_modules():
    torch.manual_seed(0)
    norm, q_norm, rotary = RMSNorm(48, EPS), RMSNorm(32, EPS), Rotary(32, theta=1e6, max_positions=16)
    with torch.no_grad():
        norm.weight.normal_(1, 0.1)
        q_norm.weight.normal_(1, 0.1)
    x, residual = torch.randn(3, 48), torch.randn(3, 48)
    out, summed = add_rms_norm_reference(x, norm.weight, EPS, residual)
    torch.testing.assert_close(summed, x + residual, atol=0, rtol=0)
    torch.testing.assert_close(out, norm(x + residual), atol=0, rtol=0)
    q, positions = torch.randn(3, 4, 32), torch.tensor([0, 7, 15])
    q_out, _ = qk_norm_rope_reference(q, q, q_norm.weight, q_norm.weight, rotary.cos, rotary.sin, positions, EPS)
    torch.testing.assert_close(q_out, rotary(q_norm(q), positions), atol=0, rtol=0)
