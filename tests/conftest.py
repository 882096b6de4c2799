"""Shared fixtures: the default model is built once per machine (models/ is git-ignored); the CPU
kernels' tests run once per instruction set this CPU has (`kernel_isa`): on an AVX-512 machine the
AVX2 build is checked too, as it runs on AVX2-only machines."""

from __future__ import annotations

from pegaserve.kernels.testing import use_interpreter_without_cuda

# Before anything imports triton: without CUDA, Triton kernels run in its interpreter.
use_interpreter_without_cuda()

import pytest  # noqa: E402

from pegaserve.cpu import kernels  # noqa: E402
from pegaserve.models.tiny import build_default_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir():
    return build_default_model()


def _forget_loaded_kernels() -> None:
    for loader in (kernels.vocab_passes, kernels.paged_attention, kernels.lm_head):
        loader.cache_clear()


@pytest.fixture(params=kernels.runnable_isas() or (None,))
def kernel_isa(request, monkeypatch):
    """The kernels loaded from now on are this instruction set's build (None: the CPU has none)."""
    monkeypatch.setattr(kernels, "isa", lambda: request.param)
    _forget_loaded_kernels()
    yield request.param
    _forget_loaded_kernels()
