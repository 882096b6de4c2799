"""Every type that crosses a boundary, frozen: what a request asks for (`SamplingParams`,
`EngineRequest`), what a step emits (`SampledToken`, `TokenScore`, `StepOutput`), what moves between
the roles (`ParkedKv`, `ReceiveTarget`, `Handoff`, `SharedReceipt`), and what an engine answers
about itself (`EngineStats`, `RequestRejected`, `EngineOverloaded`). api/, pd/ and deployments/
import these, never the engine's internals."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pegaserve.stop import StopCause, StopPolicy

if TYPE_CHECKING:
    from pegaserve.sample.grammar import GrammarSpec


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples; every default means "off". Ranges are validated at the API edge.
    The sampler applies them in the order of pegaserve/sample/sampler.py's docstring (vLLM's)."""

    temperature: float = 1.0  # below 1e-5 (vLLM's threshold): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    seed: int | None = None
    # top-N alternatives returned per token with the sampled token's own logprob; None: no logprobs,
    # and none computed, a choice's first token's neither
    num_top_logprobs: int | None = None
    min_p: float = 0.0  # drop tokens whose probability is below min_p * the best one's
    presence_penalty: float = 0.0  # OpenAI: subtracted once from every token the output holds
    frequency_penalty: float = 0.0  # OpenAI: subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # HF/vLLM: divides (logit > 0) or multiplies, over prompt + output
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token_id, bias) added to the raw logit
    allowed_token_ids: frozenset[int] | None = None  # vLLM's: every other token masked (None: all allowed)
    # vLLM's bad_words, as token sequences: each one's last token is masked where the output ends with the rest
    bad_words: tuple[tuple[int, ...], ...] = ()
    grammar: GrammarSpec | None = None  # structured outputs (pegaserve/sample/grammar.py)
    # vLLM's: each token's alternatives are these ids' logprobs instead of the top-N (num_top_logprobs = their count)
    logprob_token_ids: tuple[int, ...] | None = None

    @property
    def greedy(self) -> bool:
        # `not >=` also catches NaN; dividing by a smaller temperature can overflow fp32 logits
        return not self.temperature >= 1e-5 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether sampling reads the output so far (and, for repetition_penalty, the prompt)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass(frozen=True)
class EngineRequest:
    """What the ingress hands an engine: token ids only (stop strings stay with the ingress).

    `n` choices share one prefill: the prompt is computed once and each choice samples its own
    tokens from it, choice i with seed `sampling.seed + i`. `num_prompt_logprobs` asks prefill to
    score the prompt's tokens (None: no prompt logprobs; k: the top-k alternatives of each too).
    `cache_salt` keeps its blocks apart in the prefix cache: they are shared only with requests of
    the same salt (`block_pool.salt_root`). `priority` orders it under the priority scheduling
    policy (lower first; `EngineConfig.scheduling_policy`). `prediction` is what its output is
    expected to be (OpenAI's predicted outputs): drafts, verified as any (`speculation.PredictionProposer`).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    policy: StopPolicy
    n: int = 1
    num_prompt_logprobs: int | None = None
    cache_salt: str | None = None
    priority: int = 0
    prediction: tuple[int, ...] = ()
    arrival_s: float = field(default_factory=time.time)

    @property
    def rank(self) -> tuple[int, float]:
        """Its place under the priority policy: priority, then arrival."""
        return self.priority, self.arrival_s

    def choice_id(self, index: int) -> str:
        """The engine's key of choice `index`: the request id itself when there is one choice."""
        return self.request_id if self.n == 1 else f"{self.request_id}/{index}"

    def choice_sampling(self, index: int) -> SamplingParams:
        if index == 0 or self.sampling.seed is None:
            return self.sampling
        return replace(self.sampling, seed=self.sampling.seed + index)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None  # None where not wanted (processing.SamplingRow.wants_logprob): not computed
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True)
class TokenScore:
    """A given token under one row of logits (prompt logprobs, echo)."""

    token_id: int
    logprob: float  # the raw log-softmax
    rank: int  # 1 + the number of tokens with a strictly greater logit
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass(frozen=True)
class ParkedKv:
    """Prefill role: where a parked choice's prompt KV lies — its blocks, their generations when it
    parked (`BlockPool.generations`), and until when its lease holds them (`time.monotonic()` of
    the engine's node). Bytes read from the blocks are the prompt's if, once read, `intact` holds."""

    block_ids: tuple[int, ...]
    generations: tuple[int, ...]
    held_until: float

    def intact(self, block_ids: Sequence[int], live_generations: Sequence[int], now: float) -> bool:
        """Whether `block_ids` (some of this prompt's blocks) still held its KV while they were read —
        call it once the read is over: the lease had not run out and none of them was handed out
        anew since it parked. (The engine bumps a block's generation before anything writes into it,
        and both sides pass through locks between the write or read and the generation, so a read
        that saw new bytes sees the new generation.)"""
        expected = dict(zip(self.block_ids, self.generations))
        return now < self.held_until and all(live_generations[b] == expected.get(b) for b in block_ids)


@dataclass(frozen=True)
class ReceiveTarget:
    """Decode role: where a handoff's KV goes — the blocks after the prompt's cached prefix."""

    block_ids: tuple[int, ...]
    first_block: int  # the prompt's first block to move (the ones before it are cached here)


@dataclass(frozen=True)
class StepOutput:
    """One choice's share of one engine step: its new tokens, and its finish if it finished.

    The engine classifies every token in the step that produced it, so a token-level finish
    (`Eos`/`Token`/`Length`) always arrives with its trigger, the last of `tokens` (rule 18 holds
    by construction). A request whose prompt was scored carries `prompt_logprobs` on its first
    output: one entry per prompt token, None for the first. A choice's first output also says how
    many of its prompt's tokens the prefix cache held (`num_cached_tokens`). A step that verified
    drafts from the request's predicted output says how many of them it kept and how many it did
    not (`prediction_tokens`: OpenAI's accepted and rejected prediction tokens). In the prefill role a
    choice that parks says where its prompt's KV lies (`parked`: what its lease names).
    """

    request_id: str
    tokens: tuple[SampledToken, ...]
    finish: StopCause | None = None
    prompt_logprobs: tuple[TokenScore | None, ...] | None = None
    parked: ParkedKv | None = None
    num_cached_tokens: int | None = None
    prediction_tokens: tuple[int, int] = (0, 0)

    def then(self, later: "StepOutput") -> "StepOutput":
        """This message and a later one of the same choice as one (a consumer that fell behind)."""
        assert self.request_id == later.request_id and self.finish is None
        return StepOutput(self.request_id, self.tokens + later.tokens, later.finish,
                          self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
                          self.parked,
                          self.num_cached_tokens if self.num_cached_tokens is not None else later.num_cached_tokens,
                          add_counts(self.prediction_tokens, later.prediction_tokens))


def add_counts(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return a[0] + b[0], a[1] + b[1]


@dataclass(frozen=True)
class Handoff:
    """What prefill hands decode (rule 22): the tokens each choice still running already has —
    its first token, or every token given so far when a request resumes on another replica — and
    the prompt's KV blocks, shared by those choices.

    `kv` is the packed prompt KV, `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`,
    or None when decode must recompute (transfer failed, the lease expired, or a resume).
    """

    request: EngineRequest
    choices: tuple[tuple[int, tuple[SampledToken, ...]], ...]  # (choice index, its tokens so far)
    kv: object | None = None

    @classmethod
    def single(cls, request: EngineRequest, first_token: SampledToken, kv: object | None = None) -> "Handoff":
        return cls(request, ((0, (first_token,)),), kv)

    @property
    def choice_ids(self) -> list[str]:
        return [self.request.choice_id(index) for index, _ in self.choices]


class RequestRejected(ValueError):
    """The request can never run on this engine (it names the limit it breaks)."""


class EngineOverloaded(RuntimeError):
    """The engine's waiting queue is full: the request may succeed later (HTTP 429)."""


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_parked: int
    num_receiving: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_spec_steps: int
    num_spec_emitted_tokens: int


@dataclass(frozen=True)
class SharedReceipt:
    """`add_shared_handoff`'s answer: the blocks read from the other engine's cache (those after
    the prompt's prefix cached here) and whether they held the prompt throughout; if not, the
    request recomputes its prompt."""

    num_blocks: int
    held: bool
    seconds: float
