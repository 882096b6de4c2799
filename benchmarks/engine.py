"""Engine benchmark: pegaserve's engine against transformers `generate` on the same weights.

The same 32 prompts (16-128 tokens, deterministic) x 64 new tokens, greedy, EOS ignored, fp32,
in one process. pegaserve gets all 32 requests at once and steps until done, with at most
`max_num_seqs` sequences running (16, then 32); transformers runs batches of 16, left-padded, with
EOS switched off (and, for reference, with min_new_tokens instead). At batch 16 pegaserve also
samples, seeded, at temperature 1 alone, with presence and frequency penalties, and with top_p 0.95
(`SAMPLED_VARIANTS`: what clients send), each against its greedy time. Everything is warmed up first
and the timed runs are interleaved; the best run counts. Throughput counts output tokens only,
over the whole run (prefill included). A benchmark, not a test: it asserts nothing about speed.

Usage: ``python -m benchmarks.engine [--model DIR] [--json PATH]``.
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
SAMPLED = "pegaserve t=1"  # the same engine, temperature 1 with a seed per request (the API's default)
# What else clients send, at batch 16: penalties (processing the bounds take too), a top-p filter
# (the full logits' path)
SAMPLED_VARIANTS = {
    SAMPLED: {"temperature": 1.0},
    "t=1 penalties": {"temperature": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "t=1 top_p=0.95": {"temperature": 1.0, "top_p": 0.95},
}
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
        torch.randint(FIRST_ORDINARY_ID, LAST_ORDINARY_ID, (lengths[i],), generator=generator).tolist() for i in order
    ]


# --- pegaserve ------------------------------------------------------------------------------------


def make_engine(model_dir: Path, max_num_seqs: int, num_blocks: int | None = None):
    """fp32, sdpa attention; by default just enough 16-token blocks for every prompt at once."""
    from pegaserve.config import EngineConfig  # noqa: PLC0415
    from pegaserve.engine.build import load_engine  # noqa: PLC0415 - keep --help fast

    if num_blocks is None:
        num_blocks = NUM_PROMPTS * -(-(MAX_PROMPT_TOKENS + NEW_TOKENS) // 16)
    config = EngineConfig(num_blocks=num_blocks, max_num_seqs=max_num_seqs)
    return load_engine(model_dir, config, attention_backend="sdpa")


def run_engine(
    engine, prompts: list[list[int]], tag: str, new_tokens: int = NEW_TOKENS, temperature: float = 0.0, **sampling
) -> tuple[float, list[list[int]]]:
    """Submit every prompt (EOS ignored; greedy, or sampled at `temperature` with a seed each and
    `sampling`'s other parameters), step until done; (seconds, tokens per prompt)."""
    from pegaserve.engine.offline import run_until_idle, token_ids  # noqa: PLC0415
    from pegaserve.messages import EngineRequest, SamplingParams  # noqa: PLC0415
    from pegaserve.stop import StopPolicy  # noqa: PLC0415

    policy = StopPolicy(new_tokens, eos_token_ids=engine.model_config.eos_token_ids, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    start = time.perf_counter()
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        params = SamplingParams(temperature=temperature, seed=i, **sampling)
        engine.add_request(EngineRequest(rid, tuple(prompt), params, policy))
    outputs = run_until_idle(engine, max_steps(len(prompts), new_tokens))
    seconds = time.perf_counter() - start
    return seconds, [token_ids(outputs.get(rid, [])) for rid in ids]


def max_steps(num_requests: int, max_new_tokens: int = NEW_TOKENS) -> int:
    """A generous step budget: every request prefilled and decoded one after another, twice over."""
    return 2 * num_requests * (MAX_PROMPT_TOKENS + max_new_tokens)


# --- transformers ---------------------------------------------------------------------------------


def load_reference(model_dir: Path):
    from transformers import Qwen3ForCausalLM  # noqa: PLC0415

    return Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference_configs(model) -> dict[str, object]:
    """Two ways to make `generate` run the full length: no EOS at all (the lean one, and what
    pegaserve's ignore_eos does), or min_new_tokens, which masks EOS in the logits every step."""
    from transformers import GenerationConfig  # noqa: PLC0415

    eos_token_ids = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # else a GenerationConfig's None means "the default"
    common = {"max_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": 0}
    return {
        "hf eos off": GenerationConfig(**common),
        "hf min_new_tokens": GenerationConfig(**common, min_new_tokens=NEW_TOKENS, eos_token_id=eos_token_ids),
    }


def run_reference(model, config, prompts: list[list[int]], batch_size: int) -> tuple[float, list[list[int]]]:
    """`generate` over left-padded batches, greedy, exactly NEW_TOKENS new tokens per row."""
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: qwen3-tiny)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (best is kept)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    from pegaserve.models.tiny import build_default_model  # noqa: PLC0415

    model_dir = args.model or build_default_model()
    prompts = make_prompts()
    reference = load_reference(model_dir)
    configs = reference_configs(reference)
    engines = {batch: make_engine(model_dir, batch) for batch in ENGINE_BATCHES}
    # Warm up every path (and build lazily prepared weights), then interleave the timed runs so
    # that noise from other processes on the machine hits every configuration alike.
    for config in configs.values():
        run_reference(reference, config, prompts[:REFERENCE_BATCH], REFERENCE_BATCH)
    for batch, engine in engines.items():
        run_engine(engine, prompts[:batch], "warmup")
    for name, sampling in SAMPLED_VARIANTS.items():
        run_engine(engines[REFERENCE_BATCH], prompts[:REFERENCE_BATCH], f"warmup-{name}", **sampling)
    runs: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for repeat in range(args.repeats):
        for name, config in configs.items():
            seconds, tokens[name, REFERENCE_BATCH] = run_reference(reference, config, prompts, REFERENCE_BATCH)
            runs.setdefault((name, REFERENCE_BATCH), []).append(seconds)
        for batch, engine in engines.items():
            seconds, tokens["pegaserve", batch] = run_engine(engine, prompts, f"run{repeat}")
            runs.setdefault(("pegaserve", batch), []).append(seconds)
        for name, sampling in SAMPLED_VARIANTS.items():
            seconds, tokens[name, REFERENCE_BATCH] = run_engine(
                engines[REFERENCE_BATCH], prompts, f"{name}-{repeat}", **sampling)
            runs.setdefault((name, REFERENCE_BATCH), []).append(seconds)

    results = []
    for (name, batch), seconds in runs.items():
        num_output = sum(len(t) for t in tokens[name, batch])
        assert num_output == NUM_PROMPTS * NEW_TOKENS, f"{name}: {num_output} tokens, expected the full length"
        results.append(Result(name, batch, num_output, min(seconds), tuple(seconds)))
    by_key = {(r.name, r.batch): r for r in results}
    hf = by_key["hf eos off", REFERENCE_BATCH]
    hf_tokens = tokens["hf eos off", REFERENCE_BATCH]
    same_ids = {key: statistics.mean(a == b for a, b in zip(tokens[key], hf_tokens)) for key in tokens}

    print(
        f"{NUM_PROMPTS} prompts ({MIN_PROMPT_TOKENS}-{MAX_PROMPT_TOKENS} tokens) x {NEW_TOKENS} new tokens, greedy, "
        f"fp32, {torch.get_num_threads()} threads, model {model_dir.name}; best of {args.repeats} interleaved runs"
    )
    runs_width = 6 * args.repeats + 2
    header = ("engine", "batch", "tokens", "best s", "runs s", "tok/s", "vs hf", "same ids")
    row_format = "{:<19}{:>6}{:>8}{:>8}{:>%d}{:>9}{:>8}{:>10}" % runs_width
    print(row_format.format(*header))
    for r in results:
        print(row_format.format(
            r.name, r.batch, r.num_output_tokens, f"{r.seconds:.2f}", " ".join(f"{s:.2f}" for s in r.runs_s),
            f"{r.tokens_per_s:.1f}", f"{r.tokens_per_s / hf.tokens_per_s:.2f}x", f"{same_ids[r.name, r.batch]:.0%}",
        ))  # fmt: skip
    ours = by_key["pegaserve", REFERENCE_BATCH]
    ratios = {name: ours.tokens_per_s / by_key[name, REFERENCE_BATCH].tokens_per_s for name in configs}
    for name, ratio in ratios.items():
        print(f"pegaserve/transformers ({name}) at batch {REFERENCE_BATCH}: {ratio:.2f}x (target >= 2x)")
    sampled = by_key[SAMPLED, REFERENCE_BATCH]
    print(f"sampled (temperature 1, seeded) / greedy time at batch {REFERENCE_BATCH}: "
          f"{sampled.seconds / ours.seconds:.2f}x (target <= 1.2x)")
    for name in list(SAMPLED_VARIANTS)[1:]:
        print(f"sampled, {name.removeprefix('t=1 ')} / greedy time at batch {REFERENCE_BATCH}: "
              f"{by_key[name, REFERENCE_BATCH].seconds / ours.seconds:.2f}x")

    if args.json:
        args.json.write_text(json.dumps({
            "model": str(model_dir),
            "num_prompts": NUM_PROMPTS,
            "new_tokens": NEW_TOKENS,
            "num_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "results": [{**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results],
            "ratio_at_batch_16": ratios,
            "same_token_ids_as_hf": {f"{name}@{batch}": m for (name, batch), m in same_ids.items()},
        }, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
