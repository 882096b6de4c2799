"""Driving an engine in-process, with no event loop: step it until it has nothing left to do.

Benchmarks and tests use this; serving goes through `AsyncEngine` instead.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from pegaserve.messages import StepOutput


class SteppedEngine(Protocol):
    """What `run_until_idle` needs of an engine (`pegaserve.engine.core.EngineCore` is one)."""

    def has_work(self) -> bool: ...

    def step(self) -> list[StepOutput]: ...


class EngineNotIdle(RuntimeError):
    """The engine still had work after the step budget: a stuck request or too small a budget."""


def run_until_idle(engine: SteppedEngine, max_steps: int) -> dict[str, list[StepOutput]]:
    """Step `engine` until it has no work; each request's outputs, in order, by request id.

    Raises `EngineNotIdle` if it still has work after `max_steps` steps.
    """
    outputs: dict[str, list[StepOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    if engine.has_work():
        raise EngineNotIdle(f"engine still has work after {max_steps} steps")
    return outputs


def token_ids(outputs: Iterable[StepOutput]) -> list[int]:
    """The token ids one request's outputs carry, in order."""
    return [token.token_id for output in outputs for token in output.tokens]


def num_tokens(outputs: dict[str, list[StepOutput]]) -> int:
    """Every output token of a `run_until_idle` result."""
    return sum(len(output.tokens) for outs in outputs.values() for output in outs)
