"""`FusedLinear`: several bias-free projections of one input as one GEMM, equal to the separate
`linear`s it replaces (bit-equal from 16 rows on the CPU, where the engine decodes in batches),
rebuilt when the loader replaces a weight."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pegaserve.engine.fused_linear import FusedLinear


def linears(*shapes: tuple[int, int], seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(i, o, bias=False) for i, o in shapes]


def separate(layers: list[nn.Linear], x: torch.Tensor) -> torch.Tensor:
    return torch.cat([F.linear(x, layer.weight) for layer in layers], dim=-1)


@pytest.mark.parametrize("rows", [1, 3, 16, 33, 200])
@pytest.mark.parametrize("shapes", [[(256, 256), (256, 128), (256, 128)], [(768, 256)], [(256, 768), (256, 768)]])
def test_one_gemm_equals_the_separate_projections(rows, shapes):
    layers = linears(*shapes)
    x = torch.randn(rows, shapes[0][0])
    fused = FusedLinear(*layers)(x)
    expected = separate(layers, x)
    assert fused.shape == expected.shape
    if rows >= 16:
        assert torch.equal(fused, expected)
    else:  # a single-row GEMM may sum in another order
        torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)


def test_a_replaced_weight_is_used_from_the_next_call():
    layers = linears((64, 32), (64, 32))
    fused = FusedLinear(*layers)
    x = torch.randn(16, 64)
    before = fused(x)
    layers[1].weight = nn.Parameter(torch.randn(32, 64))  # as the loader assigns checkpoint tensors
    after = fused(x)
    assert torch.equal(after[:, :32], before[:, :32])
    assert torch.equal(after, separate(layers, x))


def test_other_dtypes_and_shapes_take_linear():
    layers = linears((64, 32))
    fused = FusedLinear(*layers)
    x3 = torch.randn(2, 16, 64)  # not [rows, features]
    assert torch.equal(fused(x3), F.linear(x3, layers[0].weight))
    bf16 = [layer.to(torch.bfloat16) for layer in linears((64, 32), seed=1)]
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    assert torch.equal(FusedLinear(*bf16)(x), F.linear(x, bf16[0].weight))
