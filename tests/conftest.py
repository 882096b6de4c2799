"""Shared fixtures: the default model is built once per machine (models/ is git-ignored)."""

from __future__ import annotations

from pegaserve_kernels.testing import use_interpreter_without_cuda

# Before anything imports triton: without CUDA, Triton kernels run in its interpreter.
use_interpreter_without_cuda()

import pytest  # noqa: E402

from pegaserve.default_model import build_default_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir():
    return build_default_model()
