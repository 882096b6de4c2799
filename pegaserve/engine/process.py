"""The engine loop in a process of its own, as vLLM runs its engine core: the model's Python never
waits for the GIL of the replica that serves it (its event loop, Ray's threads, serialization).

The replica starts `python -m pegaserve.engine.process COMMANDS MESSAGES` with one end of
each of two socket pairs: commands go down the first; answers, step outputs and health reports come
up the second, read on the replica's event loop as they arrive (as vLLM's API server reads its
engine core's outputs), with no thread of the replica in between. Messages are length-prefixed
pickles (the two processes trust each other as a process trusts itself).

The KV cache lives in a file in shared memory, mapped by both: the replica moves a handoff's blocks
in and out of it directly, never through the engine loop, and a decode replica on the same node may
map it too (the shared-memory KV transport). The file is removed when the replica shuts down or the engine
exits; one left by processes that were killed outright is removed by the next engine that starts on
the node. The child exits when its command socket closes (its replica died or shut down); the
replica sees the child's exit as EOF and fails what was in flight (`EngineDead`), and its health
check fails.
"""

from __future__ import annotations

import importlib
import logging
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pegaserve.config import EngineConfig
from pegaserve.engine.async_engine import EngineDead, EngineLink
from pegaserve.engine.commands import Command, Health
from pegaserve.engine.loop import EngineLoop, run_loop
from pegaserve.heap import freeze_startup_heap
from pegaserve.kv.files import map_kv_file

log = logging.getLogger(__name__)
_HEADER = struct.Struct("!I")
READ_BYTES = 1 << 16  # read at a time from the engine's messages (a step's outputs are a few KiB)
SHM_DIR = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


@dataclass(frozen=True)
class EngineRecipe:
    """Everything the child needs to build its engine; `builder` names a module-level function
    `(recipe, *builder_args) -> EngineCore` (the product's `build_from_recipe`, or a test double's)."""

    model_dir: str
    config: EngineConfig
    attention_backend: str = "auto"
    device: str = "cpu"
    torch_threads: int = 1
    builder: str = "pegaserve.engine.process:build_from_recipe"
    builder_args: tuple = ()


def build_from_recipe(recipe: EngineRecipe):
    from pegaserve.engine.build import load_engine  # noqa: PLC0415 - the child's import

    engine = load_engine(recipe.model_dir, recipe.config, recipe.attention_backend, recipe.device)
    # what the compiler leaves alive (transformers' modules, the tokenizer's tables: ~100k objects,
    # made after `_child_main` froze the startup heap) joins that heap, or every full collection
    # would walk it, in the middle of a step
    engine.grammars.warm_up(then=freeze_startup_heap)
    return engine


def build_engine(recipe: EngineRecipe):
    """The engine `recipe.builder` makes."""
    module, _, name = recipe.builder.partition(":")
    builder = getattr(importlib.import_module(module), name)
    return builder(recipe, *recipe.builder_args)


def _share(engine) -> tuple:
    """Make the engine's KV cache (still empty) one the replica can map: a file in /dev/shm named
    after this process, holding the blocks' generations and, on the CPU, the blocks themselves; on
    CUDA the blocks travel as torch's IPC handle of the device tensor (the reduction
    torch.multiprocessing uses)."""
    cache = engine.runner.kv_cache
    _remove_orphans()
    path = str(SHM_DIR / f"{KV_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    shape = tuple(cache.shape)
    shared_cache, generations = map_kv_file(path, shape, cache.dtype, create=True, with_blocks=not cache.is_cuda)
    engine.pool.use_generations(generations)
    if cache.is_cuda:
        from torch.multiprocessing.reductions import reduce_tensor  # noqa: PLC0415

        return ("cuda", path, shape, cache.dtype, reduce_tensor(cache))
    engine.runner.kv_cache = shared_cache
    return ("file", path, shape, cache.dtype, None)


KV_FILE_PREFIX = "pegaserve-kv-"


def _remove_orphans() -> None:
    """Remove the KV files of engines that are gone (killed with their replica, so nobody unlinked)."""
    for path in SHM_DIR.glob(f"{KV_FILE_PREFIX}*"):
        try:
            os.kill(int(path.name.removeprefix(KV_FILE_PREFIX).split("-")[0]), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except (ValueError, PermissionError):
            pass  # not ours to judge: another user's, or not named by a pid


def _map(kind: str, path: str, shape: tuple[int, ...], dtype: torch.dtype, cuda_handle) -> tuple:
    """The replica's view of the engine's KV cache (`_share`'s other half): the blocks, their
    generations, and the file that holds the blocks if any."""
    cache, generations = map_kv_file(path, shape, dtype, with_blocks=kind == "file")
    if kind == "cuda":
        rebuild, args = cuda_handle
        return rebuild(*args), generations, None
    return cache, generations, path

# --- framing -------------------------------------------------------------------------------------


def _send(sock: socket.socket, message: object, lock: threading.Lock) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        sock.sendall(_HEADER.pack(len(payload)) + payload)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, size = [], 0
    while size < n:
        chunk = sock.recv(n - size)
        if not chunk:
            return None
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> object | None:
    header = _recv_exact(sock, _HEADER.size)
    if header is None:
        return None
    payload = _recv_exact(sock, _HEADER.unpack(header)[0])
    return None if payload is None else pickle.loads(payload)


# --- the parent's side ---------------------------------------------------------------------------


class ProcessLink(EngineLink):
    """Starts the engine process and talks to it. The KV cache is a file in /dev/shm that both map;
    it is unlinked as soon as both have mapped it, so nothing outlives the two processes."""

    def __init__(self, recipe: EngineRecipe, start_timeout_s: float = 300.0) -> None:
        commands, child_commands = socket.socketpair()
        messages, child_messages = socket.socketpair()
        self._commands = commands
        self._messages = messages
        self._lock = threading.Lock()
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self._process = subprocess.Popen(
            [sys.executable, "-m", "pegaserve.engine.process", str(child_commands.fileno()),
             str(child_messages.fileno())],
            pass_fds=(child_commands.fileno(), child_messages.fileno()), env=env,
        )  # fmt: skip
        child_commands.close()
        child_messages.close()
        _send(commands, recipe, self._lock)
        messages.settimeout(start_timeout_s)
        ready = _recv(messages)
        messages.setblocking(False)  # from now on read by the event loop, as messages arrive
        if not (isinstance(ready, tuple) and ready[0] == "ready"):
            self._process.kill()
            raise EngineDead(f"the engine process did not start: {ready!r}")
        self._kv_cache, self._kv_generations, self._kv_path = _map(*ready[1:])
        self._kv_file = ready[2]
        self._health = Health(True, False, 0.0, 0, 0)
        self._health_at = time.monotonic()
        self._dead: BaseException | None = None
        self._unread = bytearray()  # the start of a message not all arrived yet
        self._wanted = 0  # that message's length, once known
        self._ended = False

    def start(self, loop, settle, publish, dead) -> None:
        self._deliver = (settle, publish, dead)
        self.loop = loop
        loop.add_reader(self._messages.fileno(), self._read)

    def rebind(self, loop) -> None:
        """Messages that came while no loop listened wait in the socket for the new one."""
        if not self._ended:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._messages.fileno())
            loop.add_reader(self._messages.fileno(), self._read)
        self.loop = loop

    def _read(self) -> None:
        """The engine's messages that arrived, each delivered at once on this (the event loop's) thread."""
        try:
            data = self._messages.recv(max(READ_BYTES, self._wanted - len(self._unread)))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._end()
            return
        if self._unread:  # the rest of a message begun before
            self._unread += data
            data = self._unread
        start = 0
        settle, publish, _ = self._deliver
        with memoryview(data) as view:
            while len(data) - start >= _HEADER.size:
                end = start + _HEADER.size + _HEADER.unpack_from(data, start)[0]
                if end > len(data):
                    break
                kind, body = pickle.loads(view[start + _HEADER.size : end])
                start = end
                try:
                    if kind == "outputs":
                        publish(body)
                    elif kind == "answer":
                        settle(*body)
                    elif kind == "health":
                        self._health, self._health_at = body, time.monotonic()
                except Exception:  # one delivery's failure must not lose the messages after it
                    log.exception("delivering the engine's %s failed", kind)
        if data is self._unread:
            del data[:start]
        elif start < len(data):
            self._unread = bytearray(data[start:])
        self._wanted = _HEADER.size + _HEADER.unpack_from(self._unread)[0] if len(self._unread) >= _HEADER.size else 0

    def _end(self) -> None:
        """The engine closed its side: it is exiting. Everything waiting fails once it has."""
        self._ended = True
        self.loop.remove_reader(self._messages.fileno())
        self._messages.close()
        loop, dead = self.loop, self._deliver[2]

        def wait() -> None:
            code = self._process.wait()
            self._dead = EngineDead(f"the engine process exited with code {code}")
            log.error("%s", self._dead)
            try:
                loop.call_soon_threadsafe(dead, self._dead)
            except RuntimeError:  # the event loop closed meanwhile
                pass

        threading.Thread(target=wait, name="pegaserve-engine-exit", daemon=True).start()

    def send(self, key: int | None, command: Command) -> None:
        if self._dead is not None:
            raise self._dead
        try:
            _send(self._commands, (key, command), self._lock)
        except OSError as exc:
            raise EngineDead(f"the engine process is gone: {exc}") from exc

    def health(self) -> Health:
        h = self._health
        alive = self._dead is None and self._process.poll() is None
        # the child reports about every second; silence is as bad as a stuck loop
        silent_s = time.monotonic() - self._health_at
        return Health(alive, h.has_work, max(h.seconds_since_step, silent_s - 1.0), h.num_steps, h.num_failed_steps)

    @property
    def kv_cache(self) -> torch.Tensor:
        return self._kv_cache

    @property
    def kv_generations(self) -> Sequence[int]:
        return self._kv_generations

    @property
    def kv_path(self) -> str | None:
        return self._kv_path

    def shutdown(self) -> None:
        try:
            self._commands.close()  # the engine exits; its messages socket closes with it
            Path(self._kv_file).unlink(missing_ok=True)  # mappings outlive the name
        finally:
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()


# --- the child's side ----------------------------------------------------------------------------


def _child_main(commands_fd: int, messages_fd: int) -> None:
    commands = socket.socket(fileno=commands_fd)
    messages = socket.socket(fileno=messages_fd)
    lock = threading.Lock()
    recipe = _recv(commands)
    torch.set_num_threads(recipe.torch_threads)
    try:
        engine = build_engine(recipe)
        shared = _share(engine)
    except Exception as exc:
        _send(messages, ("failed", f"{type(exc).__name__}: {exc}"), lock)
        raise
    core = EngineLoop(engine)
    freeze_startup_heap()
    _send(messages, ("ready", *shared), lock)
    closed = threading.Event()
    last_report = [0.0]

    def next_commands(block: bool) -> list:
        received = []
        timeout = 0.05 if block else 0.0
        while True:
            readable, _, _ = select.select([commands], [], [], timeout)
            if not readable:
                break
            message = _recv(commands)
            if message is None:
                closed.set()
                break
            received.append(message)
            timeout = 0.0
        now = time.monotonic()
        if now - last_report[0] >= 1.0:
            last_report[0] = now
            _send(messages, ("health", core.health()), lock)
        return received

    def answer(key, result, error) -> None:
        if key is None:
            return
        try:
            _send(messages, ("answer", (key, result, error)), lock)
        except (pickle.PicklingError, TypeError, AttributeError):  # an answer that cannot travel
            _send(messages, ("answer", (key, None, RuntimeError(f"{type(error or result).__name__}: {error}"))), lock)

    def publish(outputs) -> None:
        _send(messages, ("outputs", outputs), lock)

    try:
        run_loop(core, next_commands, answer, publish, closed.is_set)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the replica is gone
    finally:
        Path(shared[1]).unlink(missing_ok=True)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s")
    _child_main(int(sys.argv[1]), int(sys.argv[2]))
