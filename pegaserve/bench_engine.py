"""Engine benchmark: pegaserve's engine against transformers `generate` on the same weights.

The same 32 prompts (16-128 tokens, deterministic) x 64 new tokens, greedy, EOS ignored, fp32,
in one process. pegaserve gets all 32 requests at once and steps until done, with at most
`max_num_seqs` sequences running (16, then 32); transformers runs batches of 16, left-padded.
Both are warmed up before timing. Throughput counts output tokens only, over the whole run
(prefill included). A benchmark, not a test: it asserts nothing about speed.

Usage: ``python -m pegaserve.bench_engine [--model DIR] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

NUM_PROMPTS = 32
MIN_PROMPT_TOKENS = 16
MAX_PROMPT_TOKENS = 128
NEW_TOKENS = 64
REFERENCE_BATCH = 16
ENGINE_BATCHES = (16, 32)
PROMPT_SEED = 1234
FIRST_ORDINARY_ID, LAST_ORDINARY_ID = 100, 150_000  # clear of the special ids (151643+)


@dataclass(frozen=True)
class Result:
    name: str
    batch: int
    num_output_tokens: int
    seconds: float  # best of the timed repeats
    runs_s: tuple[float, ...]

    @property
    def tokens_per_s(self) -> float:
        return self.num_output_tokens / self.seconds


def make_prompts(num_prompts: int = NUM_PROMPTS, seed: int = PROMPT_SEED) -> list[list[int]]:
    """Deterministic prompts with lengths spread evenly over [16, 128], in shuffled order."""
    generator = torch.Generator().manual_seed(seed)
    step = (MAX_PROMPT_TOKENS - MIN_PROMPT_TOKENS) / (num_prompts - 1)
    lengths = [round(MIN_PROMPT_TOKENS + i * step) for i in range(num_prompts)]
    order = torch.randperm(num_prompts, generator=generator).tolist()
    return [
        torch.randint(FIRST_ORDINARY_ID, LAST_ORDINARY_ID, (lengths[i],), generator=generator).tolist()
        for i in order
    ]


# --- pegaserve ------------------------------------------------------------------------------------


def run_engine(model_dir: Path, prompts: list[list[int]], max_num_seqs: int) -> tuple[float, list[list[int]]]:
    """Submit every prompt, step until done; returns (seconds, tokens per prompt)."""
    from pegaserve.engine.build import load_engine  # noqa: PLC0415 - keep --help fast
    from pegaserve.engine.engine import EngineConfig  # noqa: PLC0415
    from pegaserve.engine.request import EngineRequest, SamplingParams  # noqa: PLC0415
    from pegaserve.stop import StopPolicy  # noqa: PLC0415

    num_blocks = len(prompts) * -(-(MAX_PROMPT_TOKENS + NEW_TOKENS) // 16)
    engine = load_engine(model_dir, EngineConfig(num_blocks=num_blocks, max_num_seqs=max_num_seqs), attention_backend="sdpa")
    policy = StopPolicy(NEW_TOKENS, eos_token_ids=engine.model_config.eos_token_ids, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0)
    tokens: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(EngineRequest(f"p{i}", tuple(prompt), greedy, policy))
    while engine.has_work():
        for output in engine.step():
            tokens[output.request_id] += [t.token_id for t in output.tokens]
    seconds = time.perf_counter() - start
    return seconds, [tokens[f"p{i}"] for i in range(len(prompts))]


# --- transformers ---------------------------------------------------------------------------------


def load_reference(model_dir: Path):
    from transformers import Qwen3ForCausalLM  # noqa: PLC0415

    return Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def run_reference(model, prompts: list[list[int]], batch_size: int) -> tuple[float, list[list[int]]]:
    """`generate` over left-padded batches; EOS disabled so every row runs the full length."""
    from transformers import GenerationConfig  # noqa: PLC0415

    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    tokens: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            batch = prompts[first : first + batch_size]
            width = max(len(p) for p in batch)
            input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config)
            tokens += out[:, width:].tolist()
    return time.perf_counter() - start, tokens


# --- the run --------------------------------------------------------------------------------------


def timed(name: str, batch: int, fn, repeats: int) -> tuple[Result, list[list[int]]]:
    runs, tokens = [], []
    for _ in range(repeats):
        seconds, tokens = fn()
        runs.append(seconds)
    num_output = sum(len(t) for t in tokens)
    assert num_output == NUM_PROMPTS * NEW_TOKENS, f"{name}: {num_output} tokens, expected full length"
    return Result(name, batch, num_output, min(runs), tuple(runs)), tokens


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: qwen3-tiny)")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per configuration (best is kept)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    from pegaserve.default_model import build_default_model  # noqa: PLC0415

    model_dir = args.model or build_default_model()
    prompts = make_prompts()
    warmup = prompts[:REFERENCE_BATCH]

    reference = load_reference(model_dir)
    run_reference(reference, warmup, REFERENCE_BATCH)
    hf, hf_tokens = timed("transformers", REFERENCE_BATCH, lambda: run_reference(reference, prompts, REFERENCE_BATCH), args.repeats)
    del reference

    results = [hf]
    matches: dict[int, float] = {}
    for batch in ENGINE_BATCHES:
        run_engine(model_dir, warmup, batch)
        result, tokens = timed("pegaserve", batch, lambda: run_engine(model_dir, prompts, batch), args.repeats)
        results.append(result)
        matches[batch] = statistics.mean(a == b for a, b in zip(tokens, hf_tokens))

    print(f"{NUM_PROMPTS} prompts ({MIN_PROMPT_TOKENS}-{MAX_PROMPT_TOKENS} tokens) x {NEW_TOKENS} new tokens, greedy, fp32, "
          f"{torch.get_num_threads()} threads, model {model_dir.name}")  # fmt: skip
    print(f"{'engine':<14}{'batch':>6}{'tokens':>8}{'best s':>9}{'runs s':>18}{'tok/s':>9}{'vs hf':>8}{'same ids':>10}")
    for r in results:
        runs = " ".join(f"{s:.2f}" for s in r.runs_s)
        same = "" if r is hf else f"{matches[r.batch]:.0%}"
        print(f"{r.name:<14}{r.batch:>6}{r.num_output_tokens:>8}{r.seconds:>9.2f}{runs:>18}"
              f"{r.tokens_per_s:>9.1f}{r.tokens_per_s / hf.tokens_per_s:>7.2f}x{same:>10}")  # fmt: skip
    ratio = results[1].tokens_per_s / hf.tokens_per_s
    print(f"pegaserve/transformers at batch {REFERENCE_BATCH}: {ratio:.2f}x (target >= 2x)")

    if args.json:
        args.json.write_text(json.dumps({
            "model": str(model_dir),
            "num_prompts": NUM_PROMPTS,
            "new_tokens": NEW_TOKENS,
            "num_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "results": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results],
            "ratio_at_batch_16": ratio,
            "same_token_ids": {str(b): m for b, m in matches.items()},
        }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
