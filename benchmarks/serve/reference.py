"""The reference line: transformers `generate` offline, on the same model and prompts.

`Qwen3ForCausalLM` in fp32, batch = the level's concurrency, left-padded, greedy,
`max_new_tokens` with EOS disabled (every row runs the full length), in this process with torch's
default threads. A streamer stamps each decoding step, so each row gets the same timing record
as an HTTP request: TTFT from the start of its batch, ITL from step to step. Batches run one
after another; a level stops starting batches once its time budget is spent.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from benchmarks.serve.stats import RequestTiming


class StepClock:
    """A `generate` streamer that only notes when each step's tokens arrive."""

    def __init__(self) -> None:
        self.times_s: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:  # `generate` first puts the prompt itself
            self._seen_prompt = True
            return
        self.times_s.append(time.perf_counter())

    def end(self) -> None:
        pass


class Reference:
    def __init__(self, model_dir: Path, max_new_tokens: int) -> None:
        from transformers import GenerationConfig, Qwen3ForCausalLM  # noqa: PLC0415

        self.model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.config = GenerationConfig(
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip

    def generate(self, batch: list[list[int]]) -> list[RequestTiming]:
        """One left-padded batch; a timing per row."""
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        clock = StepClock()
        timings = [RequestTiming(num_prompt_tokens=len(p), start_s=time.perf_counter()) for p in batch]
        with torch.inference_mode():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask,
                                      generation_config=self.config, streamer=clock)
        end = time.perf_counter()
        num_new = out.shape[1] - width
        assert len(clock.times_s) == num_new, f"{len(clock.times_s)} steps stamped for {num_new} tokens"
        for timing in timings:
            for t in clock.times_s:
                timing.add_chunk(t, 1)
            timing.end_s = end
        return timings

    def run_level(self, prompts: list[list[int]], batch_size: int,
                  budget_s: float) -> tuple[list[RequestTiming], float]:
        """`prompts` in batches of `batch_size`; (timings, wall seconds)."""
        timings: list[RequestTiming] = []
        start = time.perf_counter()
        for first in range(0, len(prompts), batch_size):
            if time.perf_counter() - start > budget_s:
                break
            timings += self.generate(prompts[first : first + batch_size])
        return timings, time.perf_counter() - start
