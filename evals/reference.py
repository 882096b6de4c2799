"""transformers on the served weights: what each answer should be.

The checker compares the server's loglikelihoods (a tolerance: float32 on both sides, summed in a
different order) and greedy generations (exactly) with `AutoModelForCausalLM` run here on the model
directory. A position whose best two logits are closer than `NEAR_TIE` is not compared: there a
rounding difference may rightly pick the other token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from prompts import Generated, Scored
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

NEAR_TIE = 1e-3


@dataclass(frozen=True)
class ReferenceScore:
    loglikelihood: float
    is_greedy: bool
    near_tie: bool  # is_greedy is not to be compared


@dataclass(frozen=True)
class ReferenceGeneration:
    text: str
    finish_reason: str
    stop_reason: str | None
    near_tie: bool  # some step's choice is not to be compared


class Reference:
    def __init__(self, model_dir: str) -> None:
        # The server shares these cores: one thread, as OpenMP's spinning threads would fight it.
        torch.set_num_threads(1)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])

    @torch.no_grad()
    def score(self, want: Scored) -> ReferenceScore:
        ids_cpu = torch.tensor([want.token_ids])
        start = want.num_context_tokens
        # The logits of the last context token and every continuation token: row i predicts the
        # continuation's token i (the last row, predicting past the end, is dropped).
        num_rows = len(want.token_ids) - start + 1
        logits_cpu = self.model(ids_cpu, logits_to_keep=num_rows).logits[0].float()  # [num_rows, vocab]
        predicting_cpu = logits_cpu[:-1].log_softmax(-1)
        targets_cpu = ids_cpu[0, start:]
        loglikelihood = predicting_cpu.gather(1, targets_cpu[:, None]).sum().item()
        top2_cpu = predicting_cpu.topk(2, dim=-1).values
        near_tie = bool((top2_cpu[:, 0] - top2_cpu[:, 1] < NEAR_TIE).any())
        is_greedy = bool((predicting_cpu.argmax(-1) == targets_cpu).all())
        return ReferenceScore(loglikelihood, is_greedy, near_tie)

    @torch.no_grad()
    def generate(self, want: Generated, stops: tuple[str, ...]) -> ReferenceGeneration:
        """Greedy, with docs/contract.md's stops: an EOS id, or the stop string whose match ends
        first in the generated text (equal ends: list order), cut where the match starts."""
        step_ids_cpu = torch.tensor([want.token_ids])
        cache = None
        generated: list[int] = []
        near_tie = False
        for _ in range(want.max_tokens):
            out = self.model(step_ids_cpu, cache=cache, use_cache=True, logits_to_keep=1)
            cache, logits_cpu = out.cache, out.logits[0, -1].float()
            top2_cpu = logits_cpu.topk(2).values
            near_tie |= bool(top2_cpu[0] - top2_cpu[1] < NEAR_TIE)
            token = int(logits_cpu.argmax())
            step_ids_cpu = torch.tensor([[token]])
            if token in self.eos_ids:
                return ReferenceGeneration(self._text(generated), "stop", None, near_tie)
            generated.append(token)
            text = self._text(generated)
            matches = [(text.find(s) + len(s), order, s) for order, s in enumerate(stops) if s and s in text]
            if matches:
                _, _, stop = min(matches)
                return ReferenceGeneration(text[:text.find(stop)], "stop", stop, near_tie)
        return ReferenceGeneration(self._text(generated), "length", None, near_tie)

    def _text(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
