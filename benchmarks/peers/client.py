"""The one client every system gets: vLLM's own `vllm bench serve`, run from the peers virtualenv.

Random dataset, 128 prompt tokens and 64 output tokens per request, EOS ignored, seed 0, all
requests sent at once with at most `concurrency` in flight. `temperature=None` sends no
temperature, so each server's default (1.0: sampling) applies; 0.0 is greedy.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers.servers import HOST, MODEL, VLLM_CLI

INPUT_TOKENS = 128
OUTPUT_TOKENS = 64
SEED = 0
TIMEOUT_S = 900.0  # one client run; a slow level at concurrency 1 on 2 cores takes ~2 minutes


@dataclass(frozen=True)
class ClientRun:
    """One `vllm bench serve` invocation."""

    num_prompts: int
    concurrency: int
    temperature: float | None  # None: the server's default

    @property
    def label(self) -> str:
        temperature = "default" if self.temperature is None else f"{self.temperature:g}"
        return f"c{self.concurrency}-t{temperature}-n{self.num_prompts}"

    def argv(self, peers_python: Path, port: int, model_dir: Path, result_dir: Path, filename: str) -> list[str]:
        argv = [
            str(peers_python), "-P", str(VLLM_CLI), "bench", "serve", "--backend", "vllm",
            "--host", HOST, "--port", str(port), "--model", MODEL, "--tokenizer", str(model_dir),
            "--dataset-name", "random", "--random-input-len", str(INPUT_TOKENS),
            "--random-output-len", str(OUTPUT_TOKENS), "--num-prompts", str(self.num_prompts),
            "--max-concurrency", str(self.concurrency), "--ignore-eos", "--seed", str(SEED),
            "--save-result", "--result-dir", str(result_dir), "--result-filename", filename,
        ]  # fmt: skip
        if self.temperature is not None:
            argv += ["--temperature", f"{self.temperature:g}"]
        return argv


def run_client(
    run: ClientRun, peers_python: Path, port: int, model_dir: Path, result_dir: Path, log_path: Path
) -> tuple[dict, float]:
    """Run the client once; (its saved result without per-request lists, wall seconds)."""
    filename = f"{run.label}.json"
    result_dir.mkdir(parents=True, exist_ok=True)
    (result_dir / filename).unlink(missing_ok=True)
    started = time.monotonic()
    with open(log_path, "ab") as log:
        completed = subprocess.run(
            run.argv(peers_python, port, model_dir, result_dir, filename), cwd=result_dir,
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, timeout=TIMEOUT_S, check=False,
        )  # fmt: skip
    wall_s = time.monotonic() - started
    path = result_dir / filename
    if completed.returncode != 0 or not path.exists():
        raise RuntimeError(f"vllm bench serve {run.label} exited with {completed.returncode}; see {log_path}")
    result = json.loads(path.read_text())
    return {k: v for k, v in result.items() if not isinstance(v, (list, dict))}, wall_s
