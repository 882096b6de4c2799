"""The CPU LM head (`pegaserve/cpu/lm_head.py`): the kernel (AVX-512 or AVX2) and its oneDNN fallback
against the float64 product, and the model's use of it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from pegaserve.attention.backend import SdpaBackend
from pegaserve.cpu import kernels, lm_head, vocab_passes
from pegaserve.cpu.lm_head import CpuLogits, ScreenedHead, lm_head_reference
from pegaserve.models.config import ModelConfig
from pegaserve.models.qwen3 import Qwen3ForCausalLM
from tests.helpers import on_each_kernel_build

needs_kernel = on_each_kernel_build("the fallback is tested")

ROW_COUNTS = [1, 3, 16, 17, 33, 64]
SHAPES = [(1000, 256), (1001, 128), (333, 1024)]  # (vocab N, hidden K); N not a multiple of 16 (or 48)


def _weight_and_hidden(num_rows: int, hidden_size: int, num_tokens: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(num_rows, hidden_size, generator=generator)
    hidden = torch.randn(num_tokens, hidden_size, generator=generator)
    return weight, hidden


def _relative_error(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor) -> float:
    """max |logit - exact| / (|hidden| @ |weight|.T): the error in units of the dot product's own scale."""
    scale = hidden.double().abs() @ weight.double().abs().T
    return ((logits.double() - lm_head_reference(hidden, weight)).abs() / scale).max().item()


@needs_kernel
@pytest.mark.parametrize("num_rows, hidden_size", SHAPES)
@pytest.mark.parametrize("num_tokens", ROW_COUNTS)
def test_kernel_is_as_exact_as_onednn(num_rows, hidden_size, num_tokens):
    weight, hidden = _weight_and_hidden(num_rows, hidden_size, num_tokens)
    kernel, onednn = CpuLogits(weight), CpuLogits(weight, allow_kernel=False)
    assert kernel.uses_kernel and not onednn.uses_kernel

    logits = kernel(hidden)

    assert logits.shape == (num_tokens, num_rows) and logits.dtype == torch.float32
    kernel_error = _relative_error(logits, hidden, weight)
    onednn_error = _relative_error(onednn(hidden), hidden, weight)
    assert kernel_error <= 2 * max(onednn_error, 2.0**-24)
    assert kernel_error < 4 * hidden_size**0.5 * 2.0**-24  # a random-walk bound on fp32 rounding


@needs_kernel
@pytest.mark.parametrize("num_rows, hidden_size", [(5, 1), (49, 3), (97, 600), (48, 512)])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_kernel_odd_shapes(num_rows, hidden_size, num_tokens):
    """Less than one group of vocab, one past it, a hidden size past one chunk (512), exact fits."""
    weight, hidden = _weight_and_hidden(num_rows, hidden_size, num_tokens)
    logits = CpuLogits(weight)(hidden)
    torch.testing.assert_close(logits.double(), lm_head_reference(hidden, weight), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("num_rows, hidden_size", SHAPES)
@pytest.mark.parametrize("num_tokens", [1, 17])
def test_fallback_matches_reference(num_rows, hidden_size, num_tokens):
    weight, hidden = _weight_and_hidden(num_rows, hidden_size, num_tokens)
    head = CpuLogits(weight, allow_kernel=False)

    assert not head.uses_kernel
    torch.testing.assert_close(head(hidden).double(), lm_head_reference(hidden, weight), rtol=1e-5, atol=1e-4)


@needs_kernel
def test_greedy_tokens_match_onednn_but_for_near_ties():
    weight, hidden = _weight_and_hidden(20_000, 256, 64, seed=1)
    exact = lm_head_reference(hidden, weight)
    top2 = exact.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 1e-4 * top2[:, 0].abs()

    kernel = CpuLogits(weight)(hidden).argmax(-1)
    onednn = CpuLogits(weight, allow_kernel=False)(hidden).argmax(-1)

    assert clear.sum() > 50
    assert torch.equal(kernel[clear], onednn[clear])
    assert torch.equal(kernel[clear], exact.argmax(-1)[clear])


@needs_kernel
def test_threads_split_the_vocab_without_changing_a_bit():
    weight, hidden = _weight_and_hidden(5003, 256, 9)
    head = CpuLogits(weight)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = head(hidden)
        torch.set_num_threads(3)
        three = head(hidden)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, three)


@needs_kernel
def test_no_rows_and_strided_rows():
    weight, hidden = _weight_and_hidden(100, 128, 10)
    head = CpuLogits(weight)

    assert head(hidden[:0]).shape == (0, 100)
    strided = hidden[::2]  # rows 512 bytes apart, not contiguous
    torch.testing.assert_close(head(strided), head(strided.contiguous()), rtol=0, atol=0)


def _screened_and_full(weight: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    head = CpuLogits(weight)
    return ScreenedHead.of(head).argmax(hidden), head(hidden).argmax(-1)


@needs_kernel
@pytest.mark.parametrize("num_rows, hidden_size", [*SHAPES, (97, 600), (5, 1), (48, 512), (20_000, 256)])
@pytest.mark.parametrize("num_tokens", [1, 3, 9, 16, 17])
@pytest.mark.parametrize("threads", [1, 2])
def test_greedy_head_is_the_full_heads_argmax(num_rows, hidden_size, num_tokens, threads):
    """Every shape of the kernel's tests (a vocab tail, a hidden size past one chunk of 512, less than
    a group), one thread and two: the token of the fp32 logits, not of the fp16 copy."""
    weight, hidden = _weight_and_hidden(num_rows, hidden_size, num_tokens, seed=num_tokens)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        screened, full = _screened_and_full(weight, hidden)
    finally:
        torch.set_num_threads(before)
    assert screened.dtype == torch.int64 and torch.equal(screened, full)


@needs_kernel
def test_greedy_head_settles_what_the_fp16_copy_cannot_tell_apart():
    """Entries whose fp16 copies are equal but whose fp32 logits differ in the last bits, and exact
    ties: the best fp32 logit wins, the first of equal ones; a screen with more candidates than it
    keeps falls back to the full logits, with the same answer."""
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(3000, 256, generator=generator) * 0.05
    hidden = torch.randn(6, 256, generator=generator)
    best = hidden[0] / hidden[0].norm()
    weight[100:400] = best  # 300 entries at the top for row 0, more than a screen keeps
    weight[100:400, 0] += torch.arange(300) * 2.0**-30  # fp32 steps the fp16 copy rounds away
    weight[2000] = weight[1000] = hidden[1] / hidden[1].norm()  # an exact tie for row 1
    weight[2500] = weight[1500] = weight[1000] * (1 + 2.0**-20)  # a hair above it, tied too
    assert torch.equal(weight[100:400].half(), weight[100:101].half().expand(300, -1))

    screened, full = _screened_and_full(weight, hidden)

    assert torch.equal(screened, full)
    assert screened[1] == 1500


@needs_kernel
def test_greedy_head_keeps_the_best_fp32_logit_that_its_fp16_copy_ranks_below_another():
    """The worst case of the bound: `best`'s fp32 weight sits just under each of its fp16 roundings,
    along the hidden state, so its fp16 logit falls short of its fp32 one by nearly the bound, while
    `other` is exact in fp16 and ranks above `best` there but below it in fp32. Only the upper bound
    (fp16 logit + bound) keeps `best` among the candidates."""
    generator = torch.Generator().manual_seed(3)
    hidden = torch.rand(1, 256, generator=generator) + 0.5  # all positive: along the residuals
    x = hidden[0].double()
    h = (0.02 * hidden[0]).half().float()  # best's fp16 copy
    ulp = torch.nextafter(h.half(), torch.tensor(1.0).half()).float() - h
    best, other = h + 0.8 * ulp / 2, h.clone()  # best rounds back to h; other is h itself
    gap = float(x @ (best.double() - h.double()))  # best's fp32 logit above its fp16 one
    for k in range(256):  # other one fp16 step up per coordinate until it leads by half the gap
        if float(x @ (other.double() - h.double())) >= gap / 2:
            break
        other[k] += ulp[k]
    weight = torch.randn(50, 256, generator=generator) * 0.01
    weight[10], weight[40] = best, other
    assert torch.equal(weight[10].half().float(), h) and torch.equal(weight[40].half().float(), other)
    bound = float(hidden[0].norm()) * float(lm_head.screen_bounds(other[None], other[None].half())[0])
    assert float(x @ (other.double() - h.double())) > bound  # other's lower bound is above best's fp16 logit

    screened, full = _screened_and_full(weight, hidden)

    assert full.tolist() == [10] and screened.tolist() == [10]


@needs_kernel
def test_greedy_head_falls_back_where_the_bound_does_not_hold():
    """A zero row (no error scale), a NaN and an inf in the hidden state: the full logits decide, NaN
    counting as the max as in torch.argmax."""
    weight, hidden = _weight_and_hidden(1000, 64, 5)
    hidden[0] = 0.0
    hidden[1, 3] = float("nan")
    hidden[2, 5] = float("inf")
    hidden[3] = 1e-12

    screened, full = _screened_and_full(weight, hidden)

    assert torch.equal(screened, full)
    assert screened[0] == 0  # all logits 0: the first


def test_screened_head_needs_the_kernel_and_a_weight_fp16_can_hold():
    weight, _ = _weight_and_hidden(100, 64, 1)
    assert ScreenedHead.of(CpuLogits(weight, allow_kernel=False)) is None
    if kernels.isa() is None:
        return
    head = ScreenedHead.of(CpuLogits(weight))
    scales = torch.ones(2)
    for call in (
        head.argmax,
        lambda h: head.upper_logits(h, scales, -115.0, 1024),
        lambda h: head.logits_at(h, torch.zeros(2, dtype=torch.long)),
    ):
        with pytest.raises(ValueError, match=r"\[rows, 64\]"):
            call(torch.randn(2, 32))
    with pytest.raises(ValueError, match="one vocab index per row"):
        head.logits_at(torch.randn(2, 64), torch.tensor([0, 100]))
    with pytest.raises(ValueError, match="multiple of 16"):
        head.upper_logits(torch.randn(2, 64), scales, -115.0, 1000)
    weight[7, 7] = 70_000.0  # past fp16's largest finite value
    assert ScreenedHead.of(CpuLogits(weight)) is None


@needs_kernel
@pytest.mark.parametrize("num_rows, hidden_size", [(1000, 256), (333, 1024), (97, 600)])
@pytest.mark.parametrize("threads", [1, 2])
def test_screened_heads_upper_bounds_hold_and_its_logits_are_the_full_heads(num_rows, hidden_size, threads):
    """Every upper bound is at or above the fp32 logit, by no more than twice the bound; each row's
    largest and its cell masses (the sampler's, of the bounds) come with them; a zero row's are NaN
    (no scale for its bound); `logits_at` gives the full head's floats bit for bit."""
    weight, hidden = _weight_and_hidden(num_rows, hidden_size, 9, seed=2)
    hidden[4] = 0.0
    full = CpuLogits(weight)
    head = ScreenedHead.of(full)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        scales = torch.linspace(0.5, 3.0, 9)
        (upper, row_max, masses), logits = head.upper_logits(hidden, scales, -115.0, 64), full(hidden)
    finally:
        torch.set_num_threads(before)
    columns = torch.tensor([0, 5, num_rows - 1, 17, 3, num_rows // 2, 1, 2, num_rows - 2])

    finite = torch.ones(9, dtype=torch.bool)
    finite[4] = False
    assert upper[4].isnan().all() and upper[finite].isfinite().all()
    assert row_max[4].isnan() and torch.equal(row_max[finite], upper[finite].amax(-1, keepdim=True))
    found = vocab_passes.cell_masses(upper[finite], row_max[finite], scales[finite, None], None, None, -115.0, 64)
    # the same sums but for rounding, and for entries under the floor (2^-115 each): theirs at it, ours below
    torch.testing.assert_close(masses[finite], found, rtol=1e-5, atol=1e-30)
    assert masses[4].isnan().all()
    assert (upper[finite] >= logits[finite]).all()
    scale = hidden[finite].double().norm(dim=1, keepdim=True)
    slack = 2 * scale * lm_head.screen_bounds(weight, weight.half()).double()[None]
    assert ((upper[finite].double() - logits[finite].double()) <= slack).all()
    assert torch.equal(head.logits_at(hidden, columns), logits[torch.arange(9), columns])


def test_wrong_hidden_size_and_unsupported_weight_raise():
    weight, hidden = _weight_and_hidden(100, 128, 2)
    with pytest.raises(ValueError, match=r"\[rows, 128\]"):
        CpuLogits(weight)(torch.randn(2, 64))
    assert not CpuLogits.supports(weight.bfloat16())
    with pytest.raises(ValueError, match="fp32 CPU weight"):
        CpuLogits(weight.bfloat16())


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("target_isa", list(kernels.ISA_FLAGS))
@pytest.mark.parametrize("name", ["lm_head", "vocab_passes", "paged_attention"])
def test_every_kernel_builds_from_scratch_for_every_instruction_set(name: str, target_isa: str, tmp_path: Path):
    """Built, not run: this CPU may lack the instruction set, a machine CI never sees may not."""
    built = kernels.build(name, tmp_path, target_isa)

    assert built.is_file() and built.parent.parent == tmp_path
    assert [p.name for p in built.parent.iterdir()] == [f"{name}.so"]  # no partial file left behind
    assert kernels.build(name, tmp_path, target_isa) == built  # the second call reuses it


def test_failed_build_falls_back_to_onednn(monkeypatch, caplog):
    def fail(name: str) -> Path:
        raise RuntimeError("c++ exited 1: no such flag")

    monkeypatch.setattr(kernels, "build", fail)
    monkeypatch.setattr(kernels, "isa", lambda: "avx512")
    kernels.lm_head.cache_clear()
    try:
        weight, hidden = _weight_and_hidden(100, 128, 3)
        with caplog.at_level(logging.WARNING, logger=kernels.__name__):
            heads = [CpuLogits(weight), CpuLogits(weight)]
        assert not any(head.uses_kernel for head in heads)
        assert [r.getMessage() for r in caplog.records].count(
            "LM head: the AVX-512 kernel did not build (c++ exited 1: no such flag); using oneDNN's linear"
        ) == 1  # fmt: skip
        torch.testing.assert_close(heads[0](hidden).double(), lm_head_reference(hidden, weight), rtol=1e-5, atol=1e-4)
    finally:
        kernels.lm_head.cache_clear()


def _tiny_config(vocab_size: int = 1003, hidden_size: int = 64) -> ModelConfig:
    return ModelConfig(
        model_dir=Path("unused"), vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=128,
        num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=True, max_position_embeddings=64, eos_token_ids=frozenset({0}), dtype=torch.float32,
    )  # fmt: skip


@torch.inference_mode()
def test_model_rebuilds_the_head_when_the_tied_weight_is_replaced():
    model = Qwen3ForCausalLM(_tiny_config(), SdpaBackend())
    hidden = torch.randn(5, 64)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.lm_head.weight.T)

    model.model.embed_tokens.weight = torch.nn.Parameter(torch.randn(1003, 64))
    model.lm_head.weight = model.model.embed_tokens.weight  # as the loader re-ties

    torch.testing.assert_close(model.compute_logits(hidden), hidden @ model.model.embed_tokens.weight.T)
    assert model._cpu_logits.uses_kernel == (kernels.isa() is not None)
    screened = model.screened_head()
    if kernels.isa() is None:
        assert screened is None
    else:
        assert screened.logits is model._cpu_logits  # rebuilt with it
        assert torch.equal(screened.argmax(hidden), model.compute_logits(hidden).argmax(-1))
