"""`make bench-spec`: n-gram speculative decoding on and off, the engine alone (one torch thread,
as in a replica), greedy, EOS ignored; and drafts from a request's predicted output (OpenAI's
`prediction`) with speculation off.

Two workloads. *Repetitive*: prompts whose greedy continuation repeats itself — the random-weight
default model cannot be asked to copy, so a screening run (speculation off, deterministic) picks,
from a pool of repeated-token prompts, the ones whose output an n-gram lookup predicts best: the
workload speculation is for. *Random*: random prompts, whose output rarely repeats. For each, at
batch 1 and batch 16: output tokens/s, tokens per request-step, drafts proposed and accepted.
*Predicted*: the random prompts again, each with a prediction of its output — the output itself
(right), or its first half followed by other tokens (half right) — against no prediction.
Outputs are also checked equal with and without speculation (greedy must not change).

Writes benchmarks/results/speculative.json and docs/bench/SPECULATIVE.md.

    python -m benchmarks.speculative [--new-tokens 96] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from benchmarks.reports import DOCS_DIR, RESULTS_DIR, kept_notes, machine
from pegaserve.config import EngineConfig, SpeculativeConfig
from pegaserve.engine.build import load_engine
from pegaserve.engine.offline import run_until_idle, token_ids
from pegaserve.messages import EngineRequest, SamplingParams
from pegaserve.stop import StopPolicy

OUT = DOCS_DIR  # SPECULATIVE.md
RESULTS = RESULTS_DIR  # speculative.json
MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "qwen3-tiny"
SPEC = SpeculativeConfig(num_draft_tokens=4, prompt_lookup_min=2, prompt_lookup_max=4)


def engine(spec: SpeculativeConfig | None, batch: int):
    return load_engine(MODEL_DIR, EngineConfig(num_blocks=4096, max_num_seqs=batch, speculative=spec), "sdpa")


def run(spec, prompts: list[list[int]], batch: int, new_tokens: int, repeats: int,
        predictions: list[tuple[int, ...]] | None = None) -> dict:
    best = None
    for _ in range(repeats + 1):  # the first is a warm-up
        e = engine(spec, batch)
        policy = StopPolicy(new_tokens, eos_token_ids=e.model_config.eos_token_ids, ignore_eos=True)
        for i, p in enumerate(prompts):
            e.add_request(EngineRequest(f"r{i}", tuple(p), SamplingParams(temperature=0.0), policy,
                                        prediction=predictions[i] if predictions else ()))
        start = time.perf_counter()
        outputs = run_until_idle(e, 100_000)
        seconds = time.perf_counter() - start
        stats = e.stats()
        num_tokens = sum(len(token_ids(o)) for o in outputs.values())
        result = {
            "tok_s": num_tokens / seconds, "seconds": seconds,
            "tokens": {rid: token_ids(o) for rid, o in outputs.items()},
            "drafts": stats.num_draft_tokens, "accepted": stats.num_accepted_tokens,
            "acceptance": stats.num_accepted_tokens / stats.num_draft_tokens if stats.num_draft_tokens else None,
            # each request-step emits one token without speculation; a verified step emits 1 + accepted
            "tokens_per_step": num_tokens / (num_tokens - stats.num_accepted_tokens),
        }
        if best is None or result["tok_s"] > best["tok_s"]:
            best = result
    return best


def repetitive_prompts(count: int, new_tokens: int) -> list[list[int]]:
    """The `count` repeated-token prompts (of a seeded pool) whose greedy output an n-gram lookup
    predicts best, found with speculation off."""
    rng = random.Random(11)
    pool = [[rng.randrange(100, 150_000)] * 16 for _ in range(96)]
    e = engine(None, 64)
    policy = StopPolicy(new_tokens, eos_token_ids=e.model_config.eos_token_ids, ignore_eos=True)
    for i, p in enumerate(pool):
        e.add_request(EngineRequest(f"p{i}", tuple(p), SamplingParams(temperature=0.0), policy))
    outputs = run_until_idle(e, 100_000)
    scored = sorted(((_predictable(pool[i] + token_ids(outputs[f"p{i}"])), i) for i in range(len(pool))), reverse=True)
    return [pool[i] for _, i in scored[:count]]


def _predictable(tokens: list[int]) -> int:
    """How many tokens a 2-gram lookup of the context before them would have predicted."""
    last: dict[tuple[int, int], int] = {}
    hits = 0
    for k in range(2, len(tokens)):
        follow = last.get((tokens[k - 2], tokens[k - 1]))
        hits += follow is not None and tokens[follow] == tokens[k]
        last[(tokens[k - 2], tokens[k - 1])] = k
    return hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rng = random.Random(5)
    workloads = {"repetitive": repetitive_prompts(16, args.new_tokens),
                 "random": [[rng.randrange(100, 150_000) for _ in range(64)] for _ in range(16)]}
    rows = []

    def row(name: str, batch: int, off: dict, on: dict) -> None:
        rows.append({"workload": name, "batch": batch, "off_tok_s": off["tok_s"], "on_tok_s": on["tok_s"],
                     "speedup": on["tok_s"] / off["tok_s"], "tokens_per_step": on["tokens_per_step"],
                     "drafts": on["drafts"], "accepted": on["accepted"], "acceptance": on["acceptance"],
                     "identical": on["tokens"] == off["tokens"]})
        print(rows[-1], flush=True)

    for name, prompts in workloads.items():
        for batch in (1, 16):
            chosen = prompts[:batch] if batch == 1 else prompts
            off = run(None, chosen, batch, args.new_tokens, args.repeats)
            row(name, batch, off, run(SPEC, chosen, batch, args.new_tokens, args.repeats))
            if name == "random":  # the same prompts with a prediction of their output, speculation off
                outputs = [tuple(off["tokens"][f"r{i}"]) for i in range(len(chosen))]
                half = [(*o[: len(o) // 2], *range(7000, 7000 + len(o) - len(o) // 2)) for o in outputs]
                for kind, predictions in (("right", outputs), ("half right", half)):
                    row(f"predicted ({kind})", batch, off,
                        run(None, chosen, batch, args.new_tokens, args.repeats, predictions))
    OUT.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    m = machine()
    (RESULTS / "speculative.json").write_text(json.dumps({"machine": m, "spec": vars(SPEC), "rows": rows}, indent=1))
    lines = ["# n-gram speculative decoding and predicted outputs, the engine alone", "",
             (f"`python -m benchmarks.speculative`: greedy, {args.new_tokens} tokens per request, EOS ignored, one "
              f"torch thread, {SPEC.num_draft_tokens} drafts per step, n-grams {SPEC.prompt_lookup_min}-"
              f"{SPEC.prompt_lookup_max}; best of {args.repeats} runs; *predicted* rows: speculation off, each request "
              f"with a `prediction` of its output (up to 8 drafts a step), against none. Machine: {m['cpu_model']}, "
              f"{m['nproc']} cores."), "",
             "| workload | batch | tok/s off | tok/s on | on/off | tokens per step | drafts | accepted | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = f"{r['accepted']} ({r['acceptance']:.0%})" if r["acceptance"] is not None else "0"
        lines.append(f"| {r['workload']} | {r['batch']} | {r['off_tok_s']:.0f} | {r['on_tok_s']:.0f} | "
                     f"{r['speedup']:.2f}x | {r['tokens_per_step']:.2f} | {r['drafts']} | {acc} | {r['identical']} |")
    lines += ["", "## Notes", "", kept_notes(OUT / "SPECULATIVE.md"), ""]
    (OUT / "SPECULATIVE.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
