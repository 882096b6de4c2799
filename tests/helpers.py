"""Small helpers shared by the engine tests."""

from __future__ import annotations

import pytest

from pegaserve.cpu import kernels
from pegaserve.engine.core import EngineCore
from pegaserve.engine.offline import run_until_idle, token_ids
from pegaserve.messages import EngineRequest, SamplingParams, StepOutput
from pegaserve.stop import StopPolicy

__all__ = ["EOS_IDS", "PROMPTS", "greedy_request", "kernel_marks", "on_each_kernel_build", "run_to_completion",
           "token_ids"]

EOS_IDS = frozenset({151645, 151643})


def kernel_marks(fallback: str) -> list:
    """A CPU kernel's tests: skipped where no kernel runs (`fallback` says what runs instead), else
    once per instruction set this CPU has (the `kernel_isa` fixture, conftest.py)."""
    reason = f"this CPU has neither AVX-512 nor AVX2 with FMA and F16C: the kernel cannot run ({fallback})"
    return [pytest.mark.skipif(kernels.isa() is None, reason=reason), pytest.mark.usefixtures("kernel_isa")]


def on_each_kernel_build(fallback: str):
    """`kernel_marks` as a decorator of one test."""

    def mark(test):
        for each in kernel_marks(fallback):
            test = each(test)
        return test

    return mark


def greedy_request(request_id: str, prompt: list[int], max_tokens: int, *, num_top_logprobs: int | None = None,
                   **policy) -> EngineRequest:
    policy = {"eos_token_ids": EOS_IDS, "ignore_eos": True, **policy}
    sampling = SamplingParams(temperature=0.0, num_top_logprobs=num_top_logprobs)
    return EngineRequest(request_id, tuple(prompt), sampling, StopPolicy(max_tokens, **policy))


def run_to_completion(engine: EngineCore, max_steps: int = 10_000) -> dict[str, list[StepOutput]]:
    """Step until idle; each request's outputs, in order (raises if it does not go idle)."""
    return run_until_idle(engine, max_steps)


PROMPTS = [
    [9707, 11, 1879, 0],
    [785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13],
    [16],
    list(range(1000, 1037)),
    [151644, 872, 198, 14990, 151645, 198, 151644, 77091, 198],
    list(range(5000, 5070, 3)),
    [220, 16, 11, 220, 17],
    list(range(20000, 20100)),
]
