"""Every engine and request-limit default, written once: the engine's settings (its role, the paged
KV cache, the batch budgets, speculation) and the API's request limits. The YAML's pydantic models
(pegaserve/deployments/config.py) and the command line take their defaults from here."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(str, enum.Enum):
    PREFILL = "prefill"  # computes prompts and first tokens, then holds the KV for export
    DECODE = "decode"  # continues prefilled requests (recomputes a prompt only when its KV is lost)
    BOTH = "both"  # colocated


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram (prompt-lookup) speculation: propose the `num_draft_tokens` tokens that followed the
    latest earlier occurrence of the context's last n tokens, n from `prompt_lookup_max` down to
    `prompt_lookup_min`; the target model verifies them in one step."""

    method: str = "ngram"
    num_draft_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        assert self.method == "ngram", "validated at the config edge"
        assert 1 <= self.prompt_lookup_min <= self.prompt_lookup_max and self.num_draft_tokens >= 1


@dataclass(frozen=True)
class EngineConfig:
    role: Role = Role.BOTH
    block_size: int = 16
    num_blocks: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # tokens per step; longer prompts are prefilled in chunks
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_queued_requests: int = 1024  # waiting requests past this are refused (EngineOverloaded)
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None
    lease_timeout_s: float = 60.0  # prefill role: a parked request's blocks are freed this long after it parked
    # "fcfs": first come, first served; "priority": by each request's priority (lower first), then
    # arrival, and lower-priority running requests are preempted for higher ones (vLLM's policies)
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        assert self.scheduling_policy in ("fcfs", "priority"), "validated at the config edge"


@dataclass(frozen=True)
class Limits:
    """Configurable request limits (sane defaults; the whole-vocabulary stop set must still fit)."""

    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_stop_token_ids: int = 262_144
    max_logprobs: int = 20
    max_body_bytes: int = 4 * 1024 * 1024  # a whole-vocabulary stop_token_ids list is about 1 MB
    max_prompt_tokens: int | None = None  # None: only the context length limits the prompt
    max_tokens: int | None = None  # a cap on max_tokens; None: only the context limits it
    max_choices: int = 128  # choices in one request: prompts times n (OpenAI's n is at most 128)
    max_request_tokens: int | None = None  # work per request: choices times (prompt + max_tokens); None: no cap
    max_echo_bytes: int = 16 << 20  # echo: the prompt's text times the choices it is shown in
    max_logit_bias: int = 2048  # entries in logit_bias
    max_bad_words: int = 128
    max_bad_word_chars: int = 256
    scheduling_policy: str = "fcfs"  # the engines': `priority` is accepted only under "priority"
    trust_request_chat_template: bool = False  # vLLM's --trust-request-chat-template
    refuse_unknown_fields: bool = True  # a field the API does not know is a 400 naming it (off: logged, left out)
