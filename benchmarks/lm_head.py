"""LM head benchmark: the AVX-512 kernel (`pegaserve/cpu/lm_head.py`) against oneDNN's prepacked
linear and a plain `torch.nn.functional.linear`, one thread, fp32, on the default model's head
(151936 x 256), with the screened head's argmax and upper bounds (`ScreenedHead`, an fp16 copy of the
weight: tokens, and bounds with their cell masses, where the others give logits), and the greedy
decode step of the engine at batch 16 with each.

Microbenchmark: each head called for M rows; best of `--repeats` calls after a warm-up, in rounds
of one call per head. Each call allocates its output, as the
engine's does (at 64 rows that is 39 MB, past glibc's mmap threshold: its page faults are part of
the time, for every head). Decode steps: 16 requests prefilled, then steps of 16 decode rows, the
head swapped between steps; the median step counts. A benchmark, not a test: it asserts nothing.

Usage: ``python -m benchmarks.lm_head [--model DIR] [--repeats N] [--steps N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROW_COUNTS = (1, 8, 16, 32, 64)
DECODE_BATCH = 16
PROMPT_TOKENS = 16


def timed_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def microbenchmark(weight: torch.Tensor, repeats: int) -> None:
    from pegaserve.cpu import kernels  # noqa: PLC0415 - keep --help fast
    from pegaserve.cpu.lm_head import CpuLogits, ScreenedHead  # noqa: PLC0415

    start = time.perf_counter()
    kernel = CpuLogits(weight)
    built_s = time.perf_counter() - start
    print(f"kernel head built and packed in {built_s:.2f} s (kernel: {kernel.uses_kernel}, {kernels.isa()})")
    heads = {"kernel": kernel, "onednn": CpuLogits(weight, allow_kernel=False), "linear": lambda h: F.linear(h, weight)}
    screened = ScreenedHead.of(kernel)
    if screened is not None:
        heads["argmax"] = screened.argmax
        heads["bounds"] = lambda h: screened.upper_logits(h, torch.ones(len(h)), -115.0, 1024)
    print(f"{'rows':>5} " + " ".join(f"{name + ' ms':>10}" for name in heads) + f" {'vs onednn':>10}")
    for num_tokens in ROW_COUNTS:
        hidden = torch.randn(num_tokens, weight.shape[1])
        for head in heads.values():  # warm-up
            head(hidden)
        best = dict.fromkeys(heads, float("inf"))
        for _ in range(repeats):  # one call of each head per round: a noisy neighbour hits them alike
            for name, head in heads.items():
                best[name] = min(best[name], timed_ms(lambda: head(hidden)))  # noqa: B023
        speedup = best["onednn"] / best["kernel"]
        print(f"{num_tokens:>5} " + " ".join(f"{best[name]:>10.2f}" for name in heads) + f" {speedup:>9.2f}x")


def decode_steps(engine, num_steps: int) -> None:
    from pegaserve.cpu.lm_head import CpuLogits, ScreenedHead  # noqa: PLC0415
    from pegaserve.messages import EngineRequest, SamplingParams  # noqa: PLC0415
    from pegaserve.stop import StopPolicy  # noqa: PLC0415

    model = engine.runner.model
    weight = model.lm_head.weight
    kernel = CpuLogits(weight)
    heads = {"kernel": (kernel, None), "onednn": (CpuLogits(weight, allow_kernel=False), None)}
    screened = ScreenedHead.of(kernel)
    if screened is not None:
        heads["screened"] = (kernel, screened)
    policy = StopPolicy(2 * num_steps + 8, eos_token_ids=engine.model_config.eos_token_ids, ignore_eos=True)
    generator = torch.Generator().manual_seed(0)
    for i in range(DECODE_BATCH):
        prompt = tuple(torch.randint(100, 150_000, (PROMPT_TOKENS,), generator=generator).tolist())
        engine.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(temperature=0.0), policy))
    for _ in range(3):  # the prefill, then warm decode steps
        engine.step()
    times: dict[str, list[float]] = {name: [] for name in heads}
    for _ in range(num_steps):
        for name, (head, screened) in heads.items():
            model._cpu_logits, model._screened = head, (head, screened)  # the model keeps heads built from this weight
            start = time.perf_counter()
            engine.step()
            times[name].append((time.perf_counter() - start) * 1e3)
    head, screened = heads.get("screened", heads["kernel"])
    model._cpu_logits, model._screened = head, (head, screened)
    medians = {name: statistics.median(found) for name, found in times.items()}
    steps = ", ".join(f"{name} {ms:.2f} ms ({ms / medians['onednn']:.2f}x onednn's)" for name, ms in medians.items())
    print(f"greedy decode step at batch {DECODE_BATCH}, medians of {num_steps}: {steps}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/qwen3-tiny"), help="model directory")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per head and row count")
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per head")
    args = parser.parse_args(argv)
    from pegaserve.config import EngineConfig  # noqa: PLC0415
    from pegaserve.engine.build import load_engine  # noqa: PLC0415

    torch.set_num_threads(1)
    engine = load_engine(args.model, EngineConfig(num_blocks=512, max_num_seqs=DECODE_BATCH), "sdpa")
    with torch.inference_mode():
        microbenchmark(engine.runner.model.lm_head.weight.detach(), args.repeats)
    decode_steps(engine, args.steps)


if __name__ == "__main__":
    main()
