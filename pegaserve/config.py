"""The engine's settings: its role, the paged KV cache, the batch budgets, speculation."""

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
