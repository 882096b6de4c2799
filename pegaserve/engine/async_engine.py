"""Run an `Engine` on its own thread and talk to it from asyncio.

The engine is not thread-safe: only the engine thread touches it. Callers send it commands
(callables run between steps) and receive each request's `StepOutput`s on an asyncio queue —
one message per engine step, never one call per token.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import TypeVar

from pegaserve.engine.engine import Engine
from pegaserve.engine.request import EngineRequest, Handoff, StepOutput
from pegaserve.stop import Error

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[tuple[Callable[[Engine], object], Future]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[StepOutput]]] = {}
        self._wake = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="pegaserve-engine", daemon=True)
        self._thread.start()

    # --- the engine thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopped:
            self._run_commands()
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step fails its requests, never the server
                log.exception("engine step failed")
                outputs = self._fail_all(exc)
            for output in outputs:
                self._deliver(output)

    def _run_commands(self) -> None:
        while True:
            try:
                command, future = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(command(self.engine))
            except Exception as exc:
                future.set_exception(exc)

    def _fail_all(self, exc: Exception) -> list[StepOutput]:
        request_ids = list(self.engine.requests)
        for request_id in request_ids:
            self.engine.abort(request_id)
        return [StepOutput(request_id, (), Error(f"engine step failed: {exc}")) for request_id in request_ids]

    def _deliver(self, output: StepOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            loop, outputs = stream
            loop.call_soon_threadsafe(outputs.put_nowait, output)

    # --- the asyncio side ------------------------------------------------------------------------

    async def call(self, command: Callable[[Engine], T]) -> T:
        """Run `command(engine)` on the engine thread between two steps."""
        future: Future = Future()
        self._commands.put((command, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    def call_soon(self, command: Callable[[Engine], object]) -> None:
        """Fire and forget (e.g. an abort from a `finally` that must not await)."""
        self._commands.put((command, Future()))
        self._wake.set()

    async def generate(self, spec: EngineRequest) -> AsyncIterator[StepOutput]:
        """The request's outputs until it finishes; closing the iterator early aborts it."""
        outputs = await self._admit(spec.request_id, lambda engine: engine.add_request(spec))
        async for output in self._drain(spec.request_id, outputs):
            yield output

    async def prefill(self, spec: EngineRequest) -> StepOutput:
        """Prefill role: the first token. Unless it is terminal, the request stays parked with its
        blocks until `release` (the caller owns that lease from here)."""
        outputs = await self._admit(spec.request_id, lambda engine: engine.add_request(spec))
        try:
            return await outputs.get()
        except BaseException:
            self.abort(spec.request_id)
            raise
        finally:
            self._streams.pop(spec.request_id, None)

    async def continue_handoff(self, handoff: Handoff) -> tuple[bool, AsyncIterator[StepOutput]]:
        """Decode role: admit a prefilled request. Returns whether its KV was imported (False: it
        recomputes the prompt) and its outputs after the first token."""
        request_id = handoff.request.request_id
        imported: list[bool] = []
        outputs = await self._admit(request_id, lambda engine: imported.append(engine.add_handoff(handoff)))
        return imported[0], self._drain(request_id, outputs)

    async def _admit(self, request_id: str, admit: Callable[[Engine], object]) -> asyncio.Queue[StepOutput]:
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        try:
            await self.call(admit)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return outputs

    async def _drain(self, request_id: str, outputs: asyncio.Queue[StepOutput]) -> AsyncIterator[StepOutput]:
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                while output.finish is None and not outputs.empty():
                    output = output.then(outputs.get_nowait())  # coalesce what piled up meanwhile
                finished = output.finish is not None
                yield output
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.call_soon(lambda engine: engine.abort(request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)



async def in_chunks(outputs: AsyncIterator[StepOutput], num_tokens: int) -> AsyncIterator[StepOutput]:
    """Re-cut a request's outputs into messages of at least `num_tokens` tokens (the last may be
    shorter): vLLM's stream interval, trading streaming granularity for fewer messages per token."""
    pending: StepOutput | None = None
    async for output in outputs:
        pending = output if pending is None else pending.then(output)
        if pending.finish is not None or len(pending.tokens) >= num_tokens:
            yield pending
            pending = None
    if pending is not None:
        yield pending
