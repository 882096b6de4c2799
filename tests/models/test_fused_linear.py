"""`FusedLinear`: several bias-free projections of one input as one GEMM, equal to the separate
`linear`s it replaces, rebuilt when the loader replaces a weight. On an AVX-512 or AVX2 CPU it runs the LM
head's kernel: equal within fp32 rounding, and a row's result independent of the batch around it;
elsewhere an `mm`, bit-equal from 16 rows (where the engine decodes in batches)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pegaserve.cpu import lm_head
from pegaserve.models.fused_linear import FusedLinear
from tests.helpers import on_each_kernel_build

ROWS = [1, 3, 16, 33, 200]
SHAPES = [[(256, 256), (256, 128), (256, 128)], [(768, 256)], [(256, 768), (256, 768)]]
needs_kernel = on_each_kernel_build("an `mm` is used")


def linears(*shapes: tuple[int, int], seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(i, o, bias=False) for i, o in shapes]


def separate(layers: list[nn.Linear], x: torch.Tensor) -> torch.Tensor:
    return torch.cat([F.linear(x, layer.weight) for layer in layers], dim=-1)


def exact(layers: list[nn.Linear], x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x.double() @ layer.weight.double().T for layer in layers], dim=-1)


@needs_kernel
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shapes", SHAPES)
def test_the_kernel_gives_the_separate_projections(rows, shapes):
    layers = linears(*shapes)
    x = torch.randn(rows, shapes[0][0])
    fused = FusedLinear(*layers)
    out = fused(x)
    assert fused._packed is not None  # the kernel ran
    assert out.shape == (rows, sum(o for _, o in shapes))
    torch.testing.assert_close(out.double(), exact(layers, x), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out, separate(layers, x), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_a_rows_result_does_not_depend_on_its_batch():
    layers = linears((256, 256), (256, 128), (256, 128))
    fused = FusedLinear(*layers)
    x = torch.randn(33, 256)
    batched = fused(x)
    for row in (0, 7, 8, 32):
        assert torch.equal(fused(x[row : row + 1])[0], batched[row])
    assert torch.equal(fused(x[5:21]), batched[5:21])


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("shapes", SHAPES)
def test_without_the_kernel_one_mm_equals_the_separate_projections(rows, shapes, monkeypatch):
    monkeypatch.setattr(lm_head, "has_kernel", lambda: False)
    layers = linears(*shapes)
    x = torch.randn(rows, shapes[0][0])
    fused = FusedLinear(*layers)(x)
    expected = separate(layers, x)
    assert fused.shape == expected.shape
    assert fused.data_ptr() != x.data_ptr()
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
    torch.testing.assert_close(after, separate(layers, x), rtol=1e-5, atol=1e-4)
    assert not torch.allclose(after[:, 32:], before[:, 32:])


def test_other_dtypes_and_shapes_take_linear():
    layers = linears((64, 32))
    fused = FusedLinear(*layers)
    x3 = torch.randn(2, 16, 64)  # not [rows, features]
    assert torch.equal(fused(x3), F.linear(x3, layers[0].weight))
    bf16 = [layer.to(torch.bfloat16) for layer in linears((64, 32), seed=1)]
    x = torch.randn(16, 64, dtype=torch.bfloat16)
    assert torch.equal(FusedLinear(*bf16)(x), F.linear(x, bf16[0].weight))
