"""The asyncio face of an engine loop that runs off the caller's thread: on a thread of this
process (`ThreadLink`: tests, the standalone server) or in a process of its own
(`pegaserve.engine.process.ProcessLink`: Serve replicas, so the engine's Python never
waits for the replica's GIL).

Each step's outputs arrive as one batch. Outputs of requests someone streams (`generate`,
`prefill`) go to their streams; the rest go to `on_step`, a replica-level router that forwards a
whole step at once. Replies are settled on the event loop, and only if their caller still waits.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence

import torch

from pegaserve.engine import commands
from pegaserve.engine.commands import Command, Health
from pegaserve.engine.core import EngineCore
from pegaserve.engine.loop import EngineLoop, run_loop
from pegaserve.messages import EngineRequest, EngineStats, Handoff, ReceiveTarget, StepOutput
from pegaserve.stop import Error

log = logging.getLogger(__name__)
StepSink = Callable[[list[StepOutput]], None]


class EngineDead(RuntimeError):
    """The engine loop is gone (its process exited); the replica must be replaced."""


class EngineLink(ABC):
    """Carries commands to an engine loop and its replies and outputs back to the event loop."""

    @abstractmethod
    def start(self, loop: asyncio.AbstractEventLoop, settle, publish: StepSink,
              dead: Callable[[BaseException], None]) -> None:
        """Begin delivering: `settle(key, result, error)` answers a call, `publish(outputs)` a step's
        outputs, `dead(error)` says the loop is gone for good (all on `loop`'s thread)."""

    def rebind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver to `loop` from now on (the first one closed: a new `asyncio.run`)."""
        self.loop = loop

    @abstractmethod
    def send(self, key: int | None, command: Command) -> None: ...

    @abstractmethod
    def health(self) -> Health: ...

    @property
    @abstractmethod
    def kv_cache(self) -> torch.Tensor: ...

    @property
    @abstractmethod
    def kv_generations(self) -> Sequence[int]:
        """The KV blocks' generations (`BlockPool.generations`), live: what a read of parked blocks
        is checked against."""

    @property
    def kv_path(self) -> str | None:
        """The file in shared memory that holds the KV cache, where other processes of this node can
        map it (None: the cache is private to this process, or on a GPU)."""
        return None

    @abstractmethod
    def shutdown(self) -> None: ...


class AsyncEngine:
    def __init__(self, link: EngineLink, on_step: StepSink | None = None) -> None:
        self.link = link
        self.on_step = on_step
        self._calls: dict[int, asyncio.Future] = {}
        self._next_key = 0
        self._streams: dict[str, asyncio.Queue[StepOutput]] = {}  # choice id -> its request's stream
        self._started = False
        self.on_dead: Callable[[BaseException], None] | None = None  # told when the loop is gone

    @classmethod
    def in_thread(cls, engine: EngineCore, on_step: StepSink | None = None) -> "AsyncEngine":
        return cls(ThreadLink(engine), on_step)

    def _ensure_started(self) -> None:
        loop = asyncio.get_running_loop()
        if not self._started:
            self._started = True
            self.link.start(loop, self._settle, self._publish, self.fail_everything)
        elif self.link.loop is not loop:  # a new event loop (a new asyncio.run)
            self._calls.clear()
            self._streams.clear()
            self.link.rebind(loop)

    # --- commands --------------------------------------------------------------------------------

    async def call(self, command: Command):
        """Run `command` on the engine between two steps and return its answer."""
        self._ensure_started()
        key = self._next_key = self._next_key + 1
        future = asyncio.get_running_loop().create_future()
        self._calls[key] = future
        try:
            self.link.send(key, command)
            return await future
        finally:
            self._calls.pop(key, None)

    def send(self, command: Command) -> None:
        """Fire and forget (an abort from a `finally` that must not await)."""
        self._ensure_started()
        self.link.send(None, command)

    def _settle(self, key: int, result, error: BaseException | None) -> None:
        future = self._calls.pop(key, None)
        if future is None or future.done():  # the caller gave up: nothing to answer
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def _publish(self, outputs: list[StepOutput]) -> None:
        unclaimed = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)
            else:
                unclaimed.append(output)
        if unclaimed and self.on_step is not None:
            self.on_step(unclaimed)

    def fail_everything(self, error: BaseException) -> None:
        """The loop is gone: every waiting call fails and every stream ends with an error."""
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(error)
        self._calls.clear()
        outputs = [StepOutput(choice_id, (), Error(str(error))) for choice_id in list(self._streams)]
        self._publish(outputs)
        if self.on_dead is not None:
            self.on_dead(error)

    # --- requests --------------------------------------------------------------------------------

    async def generate(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        """The outputs of every choice of `request` until all have finished (interleaved); closing the
        iterator early aborts whatever is still running."""
        choice_ids = [request.choice_id(i) for i in range(request.n)]
        outputs = await self._admit(request.request_id, choice_ids, commands.AddRequest(request))
        async for output in self._drain(request.request_id, choice_ids, outputs):
            yield output

    async def prefill(self, request: EngineRequest) -> list[StepOutput]:
        """Prefill role: each choice's first output. The non-terminal choices stay parked with the
        prompt's blocks until `release` (the caller owns that lease from here)."""
        choice_ids = [request.choice_id(i) for i in range(request.n)]
        outputs = await self._admit(request.request_id, choice_ids, commands.AddRequest(request))
        first: dict[str, StepOutput] = {}
        try:
            while len(first) < len(choice_ids):
                output = await outputs.get()
                first.setdefault(output.request_id, output)
        except BaseException:
            self.abort(request.request_id)
            raise
        finally:
            for choice_id in choice_ids:
                self._streams.pop(choice_id, None)
        return [first[c] for c in choice_ids]

    async def add_handoff(self, handoff: Handoff) -> tuple[bool, AsyncIterator[StepOutput]]:
        """Decode role, packed KV in hand: whether it was imported (False: the prompt is
        recomputed) and the outputs of its choices after their first tokens."""
        choice_ids = handoff.choice_ids
        imported: list[bool] = []
        outputs = await self._admit(handoff.request.request_id, choice_ids, commands.AddHandoff(handoff),
                                    imported.append)
        return imported[0], self._drain(handoff.request.request_id, choice_ids, outputs)

    async def _admit(self, request_id: str, choice_ids: list[str], command: Command,
                     on_answer=None) -> asyncio.Queue[StepOutput]:
        """Send a command that admits a request and register its choices' streams. A caller that
        gives up while the command is on its way leaves nothing behind: the command is sent
        already, so the engine admits the request, and the abort sent after it takes it out again
        (a prefill's parked blocks would otherwise stay until the lease expires)."""
        self._ensure_started()  # (before registering: a new event loop drops the old one's streams)
        outputs: asyncio.Queue[StepOutput] = asyncio.Queue()
        for choice_id in choice_ids:
            self._streams[choice_id] = outputs
        try:
            answer = await self.call(command)
        except BaseException as exc:
            for choice_id in choice_ids:
                self._streams.pop(choice_id, None)
            if isinstance(exc, asyncio.CancelledError):
                self.abort(request_id)
            raise
        if on_answer is not None:
            on_answer(answer)
        return outputs

    async def _drain(self, request_id: str, choice_ids: list[str], outputs: asyncio.Queue[StepOutput]):
        pending = set(choice_ids)
        try:
            while pending:
                output = await outputs.get()
                if output.finish is None:  # coalesce what piled up meanwhile (a slow consumer)
                    while not outputs.empty() and outputs._queue[0].request_id == output.request_id:  # noqa: SLF001
                        later = outputs.get_nowait()
                        output = output.then(later)
                        if later.finish is not None:
                            break
                if output.finish is not None:
                    pending.discard(output.request_id)
                yield output
        finally:
            for choice_id in choice_ids:
                self._streams.pop(choice_id, None)
            if pending:
                self.abort(request_id)

    async def receive(self, handoff: Handoff) -> ReceiveTarget | None:
        return await self.call(commands.Receive(handoff))

    async def received(self, request_id: str, ok: bool) -> None:
        await self.call(commands.Received(request_id, ok))

    async def stats(self) -> EngineStats:
        return await self.call(commands.GetStats())

    def abort(self, request_id: str) -> None:
        self.send(commands.AbortRequest(request_id))

    def release(self, request_id: str) -> None:
        self.send(commands.ReleaseRequest(request_id))

    def health(self) -> Health:
        return self.link.health()

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.link.kv_cache

    @property
    def kv_generations(self) -> Sequence[int]:
        return self.link.kv_generations

    @property
    def kv_path(self) -> str | None:
        return self.link.kv_path

    def shutdown(self) -> None:
        self.link.shutdown()


class ThreadLink(EngineLink):
    """The engine loop on a daemon thread of this process."""

    def __init__(self, engine: EngineCore) -> None:
        self.core = EngineLoop(engine)
        self._commands: queue.SimpleQueue[tuple[int | None, Command]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def start(self, loop, settle, publish, dead) -> None:
        self.loop = loop

        def answer(key, result, error) -> None:
            if key is not None:
                self.loop.call_soon_threadsafe(settle, key, result, error)

        def ship(outputs) -> None:
            self.loop.call_soon_threadsafe(publish, outputs)

        self._thread = threading.Thread(
            target=run_loop, args=(self.core, self._next_commands, answer, ship, lambda: self._stopped),
            name="pegaserve-engine", daemon=True,
        )  # fmt: skip
        self._thread.start()

    def _next_commands(self, block: bool) -> list[tuple[int | None, Command]]:
        if block and self._commands.empty():
            self._wake.wait(timeout=0.5)
        self._wake.clear()
        commands = []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def send(self, key: int | None, command: Command) -> None:
        self._commands.put((key, command))
        self._wake.set()

    def health(self) -> Health:
        alive = self._thread is None or self._thread.is_alive()
        return self.core.health(alive)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self.core.engine.runner.kv_cache

    @property
    def kv_generations(self) -> Sequence[int]:
        return self.core.engine.pool.generations

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
