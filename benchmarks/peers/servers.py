"""The servers `make bench-peers` measures, one at a time on 127.0.0.1.

A `Server` starts one system's processes in a session of their own, waits until a completion
succeeds (a listening socket or `/v1/models` answers long before the engine can serve), and on
exit stops every process it started: SIGTERM to the leader, which tears down its children (vLLM's
engine core, or the Ray instance `serve run` started), then SIGKILL to whatever of them is still
alive. Every wait is bounded in time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks.local_serve import HOST, free_port

MODEL = "qwen3-tiny"
PEGASERVE_PORT = 8000  # configs/cluster.yaml's http_options
STOP_TIMEOUT_S = 60.0
VLLM_CLI = Path(__file__).with_name("vllm_cli.py")
RAY_LLM_APP = Path(__file__).with_name("ray_llm_app.py")
READY_PROMPT = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0.0}


class ServerFailed(RuntimeError):
    """The server exited, or did not serve a completion in time (the message ends with its log)."""


@dataclass(frozen=True)
class Launch:
    """How to start one system: the command, its environment and where it answers."""

    key: str
    argv: tuple[str, ...]
    cwd: Path
    port: int
    ready_timeout_s: float
    env: dict[str, str] = field(default_factory=dict)  # added to this process's environment

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"


def port_in_use(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex((HOST, port)) == 0


def wait_port_free(port: int, timeout_s: float) -> None:
    """Someone else's server on `port` (another engineer's `make serve`): wait for it, bounded."""
    deadline = time.monotonic() + timeout_s
    announced = False
    while port_in_use(port):
        if time.monotonic() > deadline:
            raise ServerFailed(f"{HOST}:{port} stayed in use for {timeout_s:.0f} s; not starting a server there")
        if not announced:
            print(f"  {HOST}:{port} is in use by another process: waiting (at most {timeout_s:.0f} s)", flush=True)
            announced = True
        time.sleep(5)


class Server:
    """`with Server(launch, log_path) as server:` — started and ready inside, stopped after."""

    def __init__(self, launch: Launch, log_path: Path) -> None:
        self.launch = launch
        self.log_path = log_path
        self.ready_s: float | None = None  # from start to the first successful completion
        self._process: subprocess.Popen | None = None
        self._seen: dict[int, psutil.Process] = {}  # every descendant seen: all are stopped at the end

    def __enter__(self) -> Server:
        if port_in_use(self.launch.port):
            raise ServerFailed(f"{self.launch.url} is already in use")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen(
                self.launch.argv, cwd=self.launch.cwd, env={**os.environ, **self.launch.env},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        try:
            self._wait_ready(started)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - started
        self._note_descendants()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self, started: float) -> None:
        deadline = started + self.launch.ready_timeout_s
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise ServerFailed(f"{self.launch.key} exited with {self._process.returncode}\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                response = httpx.post(f"{self.launch.url}/v1/completions", json=READY_PROMPT, timeout=30)
                if response.status_code == 200 and response.json().get("choices"):
                    return
            time.sleep(2)
        timeout_s = self.launch.ready_timeout_s
        raise ServerFailed(f"{self.launch.key}: no completion within {timeout_s:.0f} s\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the leader, wait (bounded), then SIGKILL it and every descendant still alive."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        self._note_descendants(process)
        descendants = list(self._seen.values())
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        _, alive = psutil.wait_procs(descendants, timeout=10)
        for child in alive:
            with contextlib.suppress(psutil.Error):
                child.kill()
        psutil.wait_procs(alive, timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)  # the session's own group, if anything is left in it

    def _note_descendants(self, process: subprocess.Popen | None = None) -> None:
        process = process or self._process
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(process.pid).children(recursive=True):
                self._seen.setdefault(child.pid, child)

    def log_tail(self, num_lines: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(f"  | {line}" for line in lines[-num_lines:])


# --- the systems ------------------------------------------------------------------------------------


def vllm_launch(peers_python: Path, model_dir: Path, run_dir: Path) -> Launch:
    """`vllm serve` with the flags of docs (notes): fp32, 2048-token context, 4 GiB of KV cache."""
    port = free_port()
    argv = (
        str(peers_python), "-P", str(VLLM_CLI), "serve", str(model_dir), "--served-model-name", MODEL,
        "--host", HOST, "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
    )  # fmt: skip
    return Launch("vllm", argv, run_dir, port, ready_timeout_s=600, env={"VLLM_CPU_KVCACHE_SPACE": "4"})


def pegaserve_launch(key: str, config: Path, venv: Path, repo_root: Path) -> Launch:
    """`serve run CONFIG` from the repository root, on a Ray instance of its own (RAY_ADDRESS=local:
    never joining a cluster someone else started with `ray start`)."""
    argv = (str(venv / "bin" / "serve"), "run", str(config))
    from pegaserve.deployments.env import SERVE_ENV  # noqa: PLC0415 - as `make serve` runs it

    return Launch(key, argv, repo_root, PEGASERVE_PORT, ready_timeout_s=300, env={"RAY_ADDRESS": "local", **SERVE_ENV})


def ray_llm_launch(peers_python: Path, model_dir: Path, run_dir: Path) -> Launch:
    """Ray Serve LLM with vLLM-CPU as its engine (`ray_llm_app.py`), on a Ray instance of its own."""
    port = free_port()
    argv = (str(peers_python), "-P", str(RAY_LLM_APP), "--model", str(model_dir), "--port", str(port))
    return Launch("ray-llm", argv, run_dir, port, ready_timeout_s=600, env={"RAY_ADDRESS": "local"})
