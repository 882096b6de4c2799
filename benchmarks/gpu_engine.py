"""The GPU check's engine section: decode throughput of pegaserve's engine (triton and sdpa
attention) against transformers `generate`, on a random Qwen3 checkpoint of a given shape.

Weights come from `pegaserve.models.tiny.write_random_checkpoint` (the default model's recipe,
drawn on the device); the engine is stepped with `pegaserve.engine.offline.run_until_idle`.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pegaserve.config import EngineConfig
from pegaserve.engine.build import load_engine
from pegaserve.engine.offline import num_tokens, run_until_idle
from pegaserve.messages import EngineRequest, SamplingParams
from pegaserve.models.tiny import Qwen3Shape, write_random_checkpoint
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
ENGINE_RUNS = ((BACKENDS[0], (0.0, 1.0)), (BACKENDS[1], (0.0,)))  # (backend, temperatures)


@dataclass(frozen=True)
class Workload:
    """Engine vs transformers decode: `batches` of random prompts, greedy, EOS ignored."""

    batches: tuple[int, ...]
    prompt_tokens: int
    new_tokens: int
    device: str
    dtype: torch.dtype
    warmup: tuple[int, int, int]  # (batch, prompt, new tokens) run first, to compile the kernels
    repeats: int = 1  # engine runs per cell, interleaved; the best counts

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


# the warm-up's contexts run from 32 to 80 tokens: both decode variants (one split, several) compile
GPU_WORKLOAD = Workload((1, 16, 64), 128, 128, device="cuda", dtype=torch.bfloat16, warmup=(4, 32, 48), repeats=2)
DRY_WORKLOAD = Workload((1, 2), 8, 4, device="cpu", dtype=torch.float32, warmup=(1, 4, 2))


def engine_throughput(workload: Workload = GPU_WORKLOAD, shape: Qwen3Shape = QWEN3_06B_SHAPE) -> list[str]:
    """The section's markdown: a table of decode tokens/s per batch, and the targets' verdicts."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_random_checkpoint(Path(tmp), shape, dtype=workload.dtype_name, device=workload.device)
        rates = {
            f"engine {backend}{'' if temperature == 0 else f' T={temperature:g}'}": rate
            for backend, temperatures in ENGINE_RUNS
            for temperature, rate in _engine_rates(model_dir, backend, temperatures, workload).items()
        }
        rates["transformers"] = _transformers_rates(model_dir, workload)
    greedy, sampled = (f"engine {BACKENDS[0]}", f"engine {BACKENDS[0]} T=1")
    lines = [
        (
            f"Decode tokens/s after a {workload.prompt_tokens}-token prompt, {workload.new_tokens} tokens per "
            f"request, greedy unless T=1 (temperature 1, seeded; transformers greedy); prefill excluded; the engine's "
            f"best of {workload.repeats} interleaved runs; random "
            f"{workload.dtype_name} weights, {shape.num_hidden_layers} layers, hidden {shape.hidden_size}."
        ),
        "",
        "| batch | " + " | ".join(f"{name} tok/s" for name in rates) + " | engine / transformers | T=1 step / greedy |",
        "|---:|" + "---:|" * (len(rates) + 2),
    ]
    for batch in workload.batches:
        ratio = rates[greedy][batch] / rates["transformers"][batch]
        cells = [f"{rates[name][batch]:.0f}" for name in rates]
        slowdown = rates[greedy][batch] / rates[sampled][batch]
        lines.append(f"| {batch} | " + " | ".join(cells) + f" | **{ratio:.2f}x** | {slowdown:.2f}x |")
    biggest = workload.batches[-1]
    ratio = rates[greedy][biggest] / rates["transformers"][biggest]
    slowdown = rates[greedy][biggest] / rates[sampled][biggest]
    lines.append(f"\nTarget: batch {biggest} at least 3x transformers: **{_verdict(ratio >= 3)}** ({ratio:.2f}x)")
    lines.append(
        f"\nTarget: temperature 1 within 1.2x of greedy's step time at batch {biggest}: "
        f"**{_verdict(slowdown <= 1.2)}** ({slowdown:.2f}x)"
    )
    lines.append(_sampling_cost_line(biggest, shape.vocab_size, workload.device))
    return lines


def _verdict(met: bool) -> str:
    return "met" if met else "NOT met"


def decode_tokens_per_s(
    engine, batch: int, prompt_tokens: int, new_tokens: int, tag: str, temperature: float = 0.0
) -> float:
    """Decode `batch` random prompts (seeded when sampled); tokens/s from the step after every
    request's first token (prefill done) until all finish."""
    gen = torch.Generator().manual_seed(batch)
    vocab_size = engine.model_config.vocab_size
    for i in range(batch):
        prompt = torch.randint(0, vocab_size, (prompt_tokens,), generator=gen).tolist()
        policy = StopPolicy(max_tokens=new_tokens + 1, ignore_eos=True)
        sampling = SamplingParams(temperature=temperature, seed=i)
        engine.add_request(EngineRequest(f"{tag}-{batch}-{i}", tuple(prompt), sampling, policy))
    started: set[str] = set()
    while len(started) < batch and engine.has_work():
        started |= {o.request_id for o in engine.step()}
    start = time.perf_counter()
    decoded = run_until_idle(engine, max_steps=2 * batch * (prompt_tokens + new_tokens))
    return num_tokens(decoded) / (time.perf_counter() - start)


def _engine_rates(
    model_dir: Path, backend: str, temperatures: tuple[float, ...], workload: Workload
) -> dict[float, dict[int, float]]:
    config = EngineConfig(
        block_size=16,
        num_blocks=2048,
        max_num_seqs=max(workload.batches),
        max_num_batched_tokens=8192,
        max_model_len=4096,
    )
    engine = load_engine(model_dir, config, attention_backend=backend, device=workload.device, dtype=workload.dtype)
    decode_tokens_per_s(engine, *workload.warmup, f"warmup-{backend}")
    # The best of `repeats` interleaved runs, so that a slow spell of the host hits no one column alone.
    rates: dict[float, dict[int, float]] = {temperature: {} for temperature in temperatures}
    for repeat, batch, temperature in itertools.product(range(workload.repeats), workload.batches, temperatures):
        tag = f"{backend}-{temperature}-{repeat}"
        rate = decode_tokens_per_s(engine, batch, workload.prompt_tokens, workload.new_tokens, tag, temperature)
        rates[temperature][batch] = max(rate, rates[temperature].get(batch, 0.0))
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
    """Where an engine step's time goes besides the model: sampling where the logits are (what the
    runner does), greedy and at temperature 1, against the CPU route (logits to the CPU, `sample()`)."""
    try:
        from pegaserve.sample.on_device import sample_on_device
        from pegaserve.sample.processing import SamplingRow
        from pegaserve.sample.sampler import sample

        logits = torch.randn(batch, vocab_size, device=device)
        greedy = [SamplingRow(SamplingParams(temperature=0.0), 0)] * batch
        sampled = [SamplingRow(SamplingParams(temperature=1.0, seed=i), 0) for i in range(batch)]
        on_device = {name: _best_ms(lambda rows=rows: sample_on_device(logits, rows), device)
                     for name, rows in (("greedy", greedy), ("T=1", sampled))}  # fmt: skip
        to_cpu = _best_ms(lambda: logits.cpu(), device)
        cpu_logits = logits.cpu()
        on_cpu = {name: _best_ms(lambda rows=rows: sample(cpu_logits, rows), device)
                  for name, rows in (("greedy", greedy), ("T=1", sampled))}  # fmt: skip
    except (ImportError, TypeError) as e:
        return f"\n(Sampling cost not measured: {type(e).__name__}: {e}.)"
    return (
        f"\nSampling per engine step at batch {batch} (best of 3): where the logits are (the engine's route) "
        f"greedy {on_device['greedy']:.1f} ms, T=1 {on_device['T=1']:.1f} ms; through the CPU, logits to the CPU "
        f"{to_cpu:.1f} ms then `sample()` greedy {on_cpu['greedy']:.1f} ms, T=1 {on_cpu['T=1']:.1f} ms."
    )


def _best_ms(run, device: str, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _empty_cache(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
