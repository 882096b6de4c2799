"""The CPU kernels' tests run once per instruction set this CPU has (`kernel_isa`): on an AVX-512
machine the AVX2 build is checked too, as it runs on AVX2-only machines."""

from __future__ import annotations

import pytest

from pegaserve.engine import cpu_kernels, lm_head


def _forget_loaded_kernels() -> None:
    for loader in (cpu_kernels.vocab_passes, cpu_kernels.paged_attention, lm_head._load_kernel):
        loader.cache_clear()


@pytest.fixture(params=cpu_kernels.runnable_isas() or (None,))
def kernel_isa(request, monkeypatch):
    """The kernels loaded from now on are this instruction set's build (None: the CPU has none)."""
    monkeypatch.setattr(cpu_kernels, "isa", lambda: request.param)
    _forget_loaded_kernels()
    yield request.param
    _forget_loaded_kernels()
