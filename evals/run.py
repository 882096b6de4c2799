"""`make eval`: EleutherAI's lm-evaluation-harness, as a client, against a running pegaserve.

Its `local-completions` model (the OpenAI-compatible completions client) runs the local tasks of
evals/tasks (multiple choice and rolling perplexity: loglikelihood requests with echo + logprobs;
generate-until with stop sequences) against the server at --url, through a recording proxy
(evals/recorder.py), and then evals/check.py checks every answer. Nothing is downloaded: the
tasks read evals/data, the tokenizer is the served model's directory, the Hub is offline.

Usage: .venv-eval/bin/python evals/run.py [--url http://127.0.0.1:8000] [--out tmp/eval]
Exit status: 0 all well formed, 1 a check failed, 2 no server answers at --url.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import check
from recorder import Recorder

REPO = Path(__file__).resolve().parent.parent
TASKS = ("pegaserve_mc", "pegaserve_gen", "pegaserve_rolling")
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--out", type=Path, default=Path("tmp/eval"), help="run directory (emptied first)")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--batch-size", type=int, default=1, help="prompts per HTTP request")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight (num_concurrent)")
    parser.add_argument("--max-length", type=int, default=96,
                        help="the client's context length: passages longer than it take several windows")
    parser.add_argument("--timeout-s", type=int, default=900, help="lm_eval's whole run")
    args = parser.parse_args()
    os.chdir(REPO)  # the task files name their data relative to the repository root
    url = args.url.rstrip("/")

    try:
        _get_json(f"{url}/health")
        model = _get_json(f"{url}/v1/models")["data"][0]
    except (OSError, ValueError, KeyError, IndexError) as e:
        print(f"make eval: no pegaserve answers at {url} ({e}). Start `make serve` in another terminal "
              "and wait for it, or run `make eval-standalone`, which starts and stops one.", file=sys.stderr)
        return 2
    tokenizer = Path(model.get("root") or "")
    if not (tokenizer / "tokenizer.json").is_file():
        print(f"make eval: the served model's directory {tokenizer} holds no tokenizer.json here", file=sys.stderr)
        return 2

    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    recorder = Recorder(url, args.out / "traffic.jsonl")
    proxy_url = recorder.start()
    model_args = ",".join([
        f"model={model['id']}", f"base_url={proxy_url}/v1/completions", "tokenizer_backend=huggingface",
        f"tokenizer={tokenizer}", "tokenized_requests=True", f"num_concurrent={args.concurrency}",
        "max_retries=1", f"max_length={args.max_length}", "timeout=120",
    ])
    command = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
               "--tasks", args.tasks, "--include_path", "evals/tasks", "--batch_size", str(args.batch_size),
               "--log_samples", "--output_path", str(args.out / "lm_eval"), "--seed", "1234"]
    ledger_before = _ledger(url)
    started = time.monotonic()
    try:
        rc = _run_logged(command, args.out / "lm_eval.log", args.timeout_s)
    finally:
        recorder.stop()
    wall_s = time.monotonic() - started
    run = {"url": url, "model_args": model_args, "command": command, "lm_eval_rc": rc,
           "lm_eval_wall_s": round(wall_s, 1), "ledger_before": ledger_before, "ledger_after": _ledger(url)}
    (args.out / "run.json").write_text(json.dumps(run, indent=1))
    print(f"make eval: lm_eval exited {rc} after {wall_s:.1f} s; checking {args.out}")
    status = check.main([str(args.out)])
    print(f"make eval: {time.monotonic() - started:.1f} s in all")
    return status


def _run_logged(command: list[str], log_path: Path, timeout_s: float) -> int:
    """Runs `command`, its output both on the terminal and in `log_path`; kills it after `timeout_s`."""
    env = {**os.environ, **OFFLINE_ENV, "HF_DATASETS_CACHE": str(log_path.parent / "datasets-cache")}
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)

        def copy() -> None:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)

        copier = threading.Thread(target=copy, daemon=True)
        copier.start()
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            log.write(f"\nmake eval: lm_eval killed after {timeout_s} s\n")
        copier.join(timeout=10)
    return rc


def _ledger(url: str) -> dict | str:
    try:
        return _get_json(f"{url}/admin/ledger")
    except (OSError, ValueError) as e:
        return f"GET /admin/ledger failed: {e}"


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read()
    return json.loads(body) if body else {}


if __name__ == "__main__":
    sys.exit(main())
