"""The GPU check's engine section: decode throughput of pegaserve's engine (triton and sdpa
attention) against transformers `generate`, on a random Qwen3 checkpoint of a given shape.

Weights come from `pegaserve.default_model.write_random_checkpoint` (the default model's recipe,
drawn on the device); the engine is stepped with `pegaserve.engine.offline.run_until_idle`.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pegaserve.default_model import Qwen3Shape, write_random_checkpoint
from pegaserve.engine.build import load_engine
from pegaserve.engine.config import EngineConfig
from pegaserve.engine.offline import num_tokens, run_until_idle
from pegaserve.engine.request import EngineRequest, SamplingParams
from pegaserve.stop import StopPolicy

QWEN3_06B_SHAPE = Qwen3Shape(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
)  # fmt: skip
TINY_SHAPE = Qwen3Shape(
    vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16,
)  # fmt: skip
BACKENDS = ("triton", "sdpa")  # on the CPU (dry run) triton runs interpreted


@dataclass(frozen=True)
class Workload:
    """Engine vs transformers decode: `batches` of random prompts, greedy, EOS ignored."""

    batches: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int
    device: str
    dtype: torch.dtype
    warmup: tuple[int, int, int]  # (batch, prompt, new tokens) run first, to compile the kernels

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


# the warm-up's contexts run from 32 to 80 tokens: both decode variants (one split, several) compile
GPU_WORKLOAD = Workload((1, 16, 64), 128, 128, device="cuda", dtype=torch.bfloat16, warmup=(4, 32, 48))
DRY_WORKLOAD = Workload((1, 2), 8, 4, device="cpu", dtype=torch.float32, warmup=(1, 4, 2))


def engine_throughput(workload: Workload = GPU_WORKLOAD, shape: Qwen3Shape = QWEN3_06B_SHAPE) -> list[str]:
    """The section's markdown: a table of decode tokens/s per batch, and the 3x target's verdict."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_checkpoint(Path(tmp), shape, dtype=workload.dtype_name, device=workload.device)
        rates = {backend: _engine_rates(model_dir, backend, workload) for backend in BACKENDS}
        rates["transformers"] = _transformers_rates(model_dir, workload)
    columns = [f"{'' if name == 'transformers' else 'engine '}{name} tok/s" for name in rates]
    lines = [
        (
            f"Decode tokens/s after a {workload.prompt_tokens}-token prompt, {workload.new_tokens} greedy tokens "
            f"per request (prefill excluded; random {workload.dtype_name} weights, {shape.num_hidden_layers} layers, "
            f"hidden {shape.hidden_size})."
        ),
        "",
        "| batch | " + " | ".join(columns) + " | engine / transformers |",
        "|---:|" + "---:|" * (len(rates) + 1),
    ]
    for batch in workload.batches:
        ratio = rates[BACKENDS[0]][batch] / rates["transformers"][batch]
        cells = [f"{rates[name][batch]:.0f}" for name in rates]
        lines.append(f"| {batch} | " + " | ".join(cells) + f" | **{ratio:.2f}x** |")
    biggest = workload.batches[-1]
    ratio = rates[BACKENDS[0]][biggest] / rates["transformers"][biggest]
    verdict = "met" if ratio >= 3 else "NOT met"
    lines.append(f"\nTarget: batch {biggest} at least 3x transformers: **{verdict}** ({ratio:.2f}x)")
    lines.append(_sampling_cost_line(biggest, shape.vocab_size, workload.device))
    return lines


def decode_tokens_per_s(engine, batch: int, prompt_tokens: int, new_tokens: int, tag: str) -> float:
    """Greedy-decode `batch` random prompts; tokens/s from the step after every request's first
    token (prefill done) until all finish."""
    gen = torch.Generator().manual_seed(batch)
    vocab_size = engine.model_config.vocab_size
    for i in range(batch):
        prompt = torch.randint(0, vocab_size, (prompt_tokens,), generator=gen).tolist()
        policy = StopPolicy(max_tokens=new_tokens + 1, ignore_eos=True)
        engine.add_request(EngineRequest(f"{tag}-{batch}-{i}", tuple(prompt), SamplingParams(temperature=0.0), policy))
    started: set[str] = set()
    while len(started) < batch and engine.has_work():
        started |= {o.request_id for o in engine.step()}
    start = time.perf_counter()
    decoded = run_until_idle(engine, max_steps=2 * batch * (prompt_tokens + new_tokens))
    return num_tokens(decoded) / (time.perf_counter() - start)


def _engine_rates(model_dir: Path, backend: str, workload: Workload) -> dict[int, float]:
    config = EngineConfig(
        block_size=16,
        num_blocks=2048,
        max_num_seqs=max(workload.batches),
        max_num_batched_tokens=8192,
        max_model_len=4096,
    )
    engine = load_engine(model_dir, config, attention_backend=backend, device=workload.device, dtype=workload.dtype)
    decode_tokens_per_s(engine, *workload.warmup, f"warmup-{backend}")
    rates = {
        batch: decode_tokens_per_s(engine, batch, workload.prompt_tokens, workload.new_tokens, backend)
        for batch in workload.batches
    }
    del engine
    _empty_cache(workload.device)
    return rates


def _transformers_rates(model_dir: Path, workload: Workload) -> dict[int, float]:
    """generate() decode tokens/s: (time for N tokens - time for 1) covers N - 1 decode steps."""
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=workload.dtype).to(workload.device).eval()
    n = workload.new_tokens
    with torch.inference_mode():
        _generate_s(model, workload, 2, 4)  # warm-up
        rates = {
            b: b * (n - 1) / (_generate_s(model, workload, b, n) - _generate_s(model, workload, b, 1))
            for b in workload.batches
        }
    del model
    _empty_cache(workload.device)
    return rates


def _generate_s(model, workload: Workload, batch: int, new_tokens: int) -> float:
    """Seconds for one greedy `generate` of exactly `new_tokens` tokens per random prompt."""
    ids = torch.randint(0, model.config.vocab_size, (batch, workload.prompt_tokens), device=workload.device)
    _sync(workload.device)
    start = time.perf_counter()
    model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0,
    )  # fmt: skip
    _sync(workload.device)
    return time.perf_counter() - start


def _sampling_cost_line(batch: int, vocab_size: int, device: str) -> str:
    """Where an engine step's host time goes besides the model: logits to the CPU and sampling.
    The sampler's internals may change under it: then the line says so and the section stands."""
    try:
        from pegaserve.engine.sampler import SamplingRow, sample

        logits = torch.randn(batch, vocab_size, device=device)
        rows = [SamplingRow(SamplingParams(temperature=0.0), 0, frozenset())] * batch
        _sync(device)
        start = time.perf_counter()
        cpu_logits = logits.cpu()
        copied = time.perf_counter()
        sample(cpu_logits, rows)
        done = time.perf_counter()
    except (ImportError, TypeError) as e:
        return f"\n(Sampling cost not measured: {type(e).__name__}: {e}.)"
    return (
        f"\nPer engine step at batch {batch}, outside the model: logits to the CPU {1e3 * (copied - start):.1f} ms, "
        f"greedy `sample()` on the CPU {1e3 * (done - copied):.1f} ms."
    )


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _empty_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
