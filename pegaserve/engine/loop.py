"""The engine loop: commands between steps, one batch of outputs after each step.

`EngineLoop` owns an `EngineCore` and is the only code that touches it. Callers send it typed commands
(frozen dataclasses, never callables, so they can cross a process boundary) and receive every
step's outputs as one list. The loop never dies of a request: a command that fails answers its
caller with the exception; a step that fails fails the requests it was running (each gets an
`Error` finish) and the loop goes on. Commands whose caller has gone away are skipped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from pegaserve.engine.commands import (
    AbortRequest,
    AddHandoff,
    AddRequest,
    AddSharedHandoff,
    Command,
    ExportKv,
    GetStats,
    Health,
    Receive,
    Received,
    ReleaseRequest,
    SharedKv,
)
from pegaserve.engine.core import EngineCore
from pegaserve.kv.files import MappedKvFiles
from pegaserve.messages import StepOutput

log = logging.getLogger(__name__)
LEASE_CHECK_PERIOD_S = 0.5

class EngineLoop:
    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.num_steps = 0
        self.num_failed_steps = 0
        self.last_progress_s = time.monotonic()
        self._leases_checked_s = 0.0
        # Pages fault in on first touch: populating a whole cache would stall the loop.
        self._sources = MappedKvFiles(populate=False)

    def execute(self, command: Command):
        """Run one command between steps; exceptions reach the caller, never the loop."""
        engine = self.engine
        match command:
            case AddRequest(request):
                return engine.add_request(request)
            case Receive(handoff):
                return engine.receive(handoff)
            case AddHandoff(handoff):
                return engine.add_handoff(handoff)
            case AddSharedHandoff(handoff, source):
                return engine.add_shared_handoff(handoff, *self._mapped(source), source.parked)
            case Received(request_id, ok):
                return engine.received(request_id, ok)
            case AbortRequest(request_id):
                return engine.abort(request_id)
            case ReleaseRequest(request_id):
                return engine.release(request_id)
            case ExportKv(request_id, first_block):
                return engine.export_kv(request_id, first_block)
            case GetStats():
                return engine.stats()
        raise TypeError(f"unknown engine command {command!r}")

    def _mapped(self, source: SharedKv) -> tuple[torch.Tensor | None, Sequence[int]]:
        """Another engine's cache and its blocks' generations; (None, ()) when the file is gone
        (its engine died)."""
        try:
            return self._sources.get(source.path, source.shape, self.engine.kv_dtype)
        except (OSError, ValueError) as exc:
            log.warning("cannot map the KV cache %s (%s); the prompt is recomputed", source.path, exc)
            return None, ()

    def step(self) -> list[StepOutput]:
        """One engine step. A failure fails the step's requests, not the engine."""
        now = time.monotonic()
        if self.engine.parked and now - self._leases_checked_s >= LEASE_CHECK_PERIOD_S:
            self._leases_checked_s = now
            for request_id in self.engine.expire_leases():
                log.warning("KV lease of %s expired; decode will recompute", request_id)
        if not self.engine.has_work():
            self.last_progress_s = time.monotonic()
            return []
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed")
            self.num_failed_steps += 1
            outputs = self.engine.fail_running(f"engine step failed: {type(exc).__name__}")
        self.num_steps += 1
        self.last_progress_s = time.monotonic()
        return outputs

    def health(self, alive: bool = True) -> Health:
        return Health(alive, self.engine.has_work(), time.monotonic() - self.last_progress_s, self.num_steps,
                      self.num_failed_steps)


def run_loop(core: EngineLoop, next_commands: Callable[[bool], list[tuple[object, Command]]],
             answer: Callable[[object, object, BaseException | None], None],
             publish: Callable[[list[StepOutput]], None], stopped: Callable[[], bool]) -> None:
    """The engine loop, over any link: `next_commands(block)` returns (reply key, command)
    pairs (blocking briefly only when idle); `answer(key, result, error)` replies to one;
    `publish(outputs)` ships a step's outputs."""
    while not stopped():
        for key, command in next_commands(not core.engine.has_work()):
            try:
                result, error = core.execute(command), None
            except Exception as exc:  # the caller's problem (a rejected request), not the loop's
                result, error = None, exc
            try:
                answer(key, result, error)
            except Exception:  # the caller is gone (cancelled, disconnected): skip it
                log.debug("could not answer an engine command", exc_info=True)
        outputs = core.step()
        if outputs:
            try:
                publish(outputs)
            except Exception:  # nobody to deliver to (the caller's event loop closed): the loop goes on
                log.warning("could not deliver a step's outputs", exc_info=True)
