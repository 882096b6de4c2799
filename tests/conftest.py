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


# Over ~10 s a file (or a few seconds a test) on the 2-core dev machine: statistical laws, whole
# load-test and fuzz runs, engine processes started, builds from scratch. `make test` runs them;
# the quick loop (`pytest -m "not ray and not slow"`, `make test-quick`) leaves them out.
SLOW = (
    "tests/sample/test_screened.py",
    "tests/sample/test_grammar.py",
    "tests/api/test_loadtest.py",
    "tests/api/test_fuzz.py",
    "tests/engine/test_async_engine.py",
    "tests/engine/test_engine_parity.py",
    "tests/models/test_tiny.py",
    "tests/kernels/test_triton_backend.py",
    "tests/kernels/test_gpu_check.py",
    "tests/kernels/test_compile.py",
    "tests/cpu/test_lm_head.py::test_every_kernel_builds_from_scratch_for_every_instruction_set",
    "tests/api/test_sampling_params.py::test_a_temperature_below_1e_5_is_greedy",
    "tests/api/test_sampling_params.py::test_penalties_equal_the_reference",
    "tests/api/test_tokenize.py::test_a_huge_prompt_is_tokenized_while_the_event_loop_keeps_serving",
    "tests/api/test_robustness.py::test_failures_reach_the_client_without_internals",
    "tests/api/test_chat_template.py::test_documents_and_reasoning_effort_reach_a_template_that_reads_them",
    "tests/api/test_chat_template.py::test_a_requests_own_chat_template_only_where_the_server_trusts_it",
    "tests/engine/test_engine_roles.py::test_a_shared_prompt_that_did_not_hold_is_recomputed",
    "tests/sample/test_processing.py::test_filters_are_exact_across_the_inverse_cdfs_cells",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith("tests/serve/"):
            item.add_marker(pytest.mark.ray)  # every Serve test starts Ray
        if item.nodeid.split("[")[0].startswith(SLOW):
            item.add_marker(pytest.mark.slow)
