"""The sampler's vectorized passes (`pegaserve/cpu/csrc/vocab_passes.cpp`) against their torch
references, the sampler's own torch paths: the argmax exactly; cell masses within float rounding;
top-p bounds equal. And `sample()` draws the same tokens either way, so the kernel is a pure speed-up
of what the statistical tests in test_sampler*.py check on whichever path this machine runs."""

import math

import pytest
import torch

from pegaserve.cpu import vocab_passes
from pegaserve.messages import SamplingParams
from pegaserve.sample import filters, passes, sampler
from pegaserve.sample.processing import SamplingRow
from tests.helpers import kernel_marks

pytestmark = kernel_marks("torch's path is used")
FLOOR, CELL, BUCKETS = passes.FLOOR, passes.CELL, passes.TOP_P_BUCKETS


def test_the_kernel_builds_and_loads():
    assert vocab_passes._library() is not None  # else every comparison below is torch against torch


def logits(num_rows: int, vocab: int, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 1000, 4097, 151936])
def test_max_argmax_is_torchs(vocab):
    x = logits(5, vocab, seed=vocab)
    x[1] = float("-inf")  # all masked: index 0
    x[2, vocab // 2 :] = x[2].max()  # ties: the first
    x[3, -1] = 1e9
    maxima, argmax = vocab_passes.max_argmax(x)
    assert torch.equal(argmax, x.argmax(-1)) and torch.equal(maxima[:, 0], x.amax(-1))
    rows = torch.tensor([4, 0, 4])
    maxima, argmax = vocab_passes.max_argmax(x, rows)
    assert torch.equal(argmax, x[rows].argmax(-1))


def test_max_argmax_of_some_rows_is_torchs_on_either_path(monkeypatch):
    x = logits(6, 4097, seed=3)
    rows = torch.tensor([5, 1, 1])
    for _ in range(2):  # the kernel, then torch's path
        maxima, argmax = passes.max_argmax_rows(x, rows)
        assert torch.equal(argmax, x[rows].argmax(-1)) and torch.equal(maxima[:, 0], x[rows].amax(-1))
        monkeypatch.setattr(vocab_passes, "_library", lambda: None)


def test_a_nan_counts_as_the_max_as_in_torch():
    x = logits(2, 300)
    x[0, 7], x[0, 100] = float("nan"), float("nan")
    maxima, argmax = vocab_passes.max_argmax(x)
    assert argmax.tolist() == x.argmax(-1).tolist() and math.isnan(maxima[0, 0])


@pytest.mark.parametrize("vocab", [17, 1024, 3000, 151936])
@pytest.mark.parametrize("bounded", [False, True])
def test_cell_masses_match_the_torch_path(vocab, bounded, monkeypatch):
    x = logits(4, vocab, seed=vocab, scale=6.0)
    x[1, ::3] = float("-inf")
    shift = x.amax(-1, keepdim=True)
    scale = torch.tensor([[1.0], [2.0], [0.3], [50.0]]) * passes.LOG2_E
    lower = torch.tensor([[float("-inf")], [0.0], [2.0], [float("-inf")]]) if bounded else None
    rows = torch.tensor([3, 2, 1, 0])
    found = vocab_passes.cell_masses(x, shift, scale, rows, lower, FLOOR, CELL)
    monkeypatch.setattr(vocab_passes, "_library", lambda: None)
    expected = passes.cell_masses(x, shift, scale, rows, lower)
    torch.testing.assert_close(found, expected, rtol=2e-6, atol=0.0)


@pytest.mark.parametrize("p", [0.05, 0.5, 0.9, 0.999])
@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_top_p_bounds_equal_the_torch_paths(p, temperature, monkeypatch):
    x = logits(6, 151936, seed=int(p * 1000), scale=4.0)
    x[5, 10:20] = x[5].max() + 5  # a run of equal best tokens
    shift = x.amax(-1, keepdim=True)
    scale = torch.full((6, 1), passes.LOG2_E / temperature)
    lower = torch.full((6, 1), float("-inf"))
    lower[2] = x[2].kthvalue(151936 - 40).values  # top-k came first
    found = filters.top_p_bound(x, None, shift, scale, lower, [p] * 6)
    monkeypatch.setattr(vocab_passes, "_library", lambda: None)
    assert torch.equal(found, filters.top_p_bound(x, None, shift, scale, lower, [p] * 6))


PARAMS = [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.7}, {"top_p": 0.9}, {"top_k": 40},
          {"min_p": 0.05, "temperature": 1.3}, {"top_p": 0.8, "top_k": 100, "temperature": 0.6},
          {"frequency_penalty": 0.5, "top_p": 0.95}]


def test_sample_draws_the_same_tokens_and_logprobs_on_either_path(monkeypatch):
    x = logits(len(PARAMS) * 3, 151936, seed=11)
    rows = [SamplingRow(SamplingParams(seed=i, num_top_logprobs=2, **PARAMS[i % len(PARAMS)]), i, frozenset(),
                        (1, 2, 2)) for i in range(x.shape[0])]
    fast = sampler.sample(x, rows)
    monkeypatch.setattr(vocab_passes, "_library", lambda: None)
    slow = sampler.sample(x, rows)
    assert [t.token_id for t in fast] == [t.token_id for t in slow]
    for a, b in zip(fast, slow):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [i for i, _ in a.top_logprobs] == [i for i, _ in b.top_logprobs]
