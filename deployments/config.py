"""The application's arguments (the `args:` of configs/cluster.yaml), validated once at the edge."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

import pegaserve.deployments.transports  # noqa: F401 - registers the Ray-backed KV transports
from pegaserve.api.guards import LOOPBACK_HOSTS
from pegaserve.api.responses.store import MAX_BYTES as MAX_STORED_BYTES
from pegaserve.api.responses.store import MAX_RESPONSES as MAX_STORED_RESPONSES
from pegaserve.api.model_info import served_name
from pegaserve.attention.registry import AUTO, check_backend_name
from pegaserve.config import EngineConfig, Limits, SpeculativeConfig
from pegaserve.models.tiny import DEFAULT_MODEL_NAME, ensure_model_dir
from pegaserve.pd.transports.registry import (
    DEFAULT_TRANSPORT,
    check_transport_name,
    describe_transports,
    transport_class,
)

API_KEYS_ENV = "PEGASERVE_API_KEYS"
ADMIN_API_KEYS_ENV = "PEGASERVE_ADMIN_API_KEYS"
# every default below is pegaserve.config's, written there once
ENGINE, SPECULATIVE, LIMITS = EngineConfig(), SpeculativeConfig(), Limits()


class EngineArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    block_size: int = Field(ENGINE.block_size, ge=1, description="tokens per KV block")
    num_blocks: int = Field(ENGINE.num_blocks, ge=1, description="KV blocks per replica")
    max_num_seqs: int = Field(ENGINE.max_num_seqs, ge=1, description="requests decoded together")
    max_num_batched_tokens: int = Field(
        ENGINE.max_num_batched_tokens, ge=1, description="tokens per engine step; longer prompts are prefilled in chunks of this size")
    max_queued_requests: int = Field(ENGINE.max_queued_requests, ge=1, description="waiting requests per replica before 429")
    max_model_len: int | None = Field(ENGINE.max_model_len, ge=2, description="context length; default: the model's")
    attention_backend: str = Field(AUTO, description="a registered attention backend (pegaserve.attention.registry): "
                                   "sdpa (torch) or triton; auto: triton on CUDA, else sdpa")
    device: Literal["cpu", "cuda"] = "cpu"
    torch_threads: int = Field(1, ge=1, description="intra-op threads of each replica's engine process")
    enable_prefix_caching: bool = Field(ENGINE.enable_prefix_caching, description="reuse the KV of cached prompt prefixes")
    separate_process: bool = Field(
        True, description="run each replica's engine loop in a process of its own (off its replica's GIL)")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        ENGINE.scheduling_policy, description="fcfs: first come, first served; priority: by each request's `priority` (lower "
        "first), then arrival, preempting lower-priority running requests for higher ones (vLLM's policies)")

    @field_validator("attention_backend")
    @classmethod
    def _known_attention_backend(cls, name: str) -> str:
        return check_backend_name(name)


class SpeculativeArgs(BaseModel):
    """n-gram (prompt-lookup) speculative decoding, as vLLM's `ngram` method."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["ngram"] = "ngram"
    num_draft_tokens: int = Field(SPECULATIVE.num_draft_tokens, ge=1, le=16, description="tokens proposed per step and verified in one")
    prompt_lookup_min: int = Field(SPECULATIVE.prompt_lookup_min, ge=1, description="shortest n-gram to match")
    prompt_lookup_max: int = Field(SPECULATIVE.prompt_lookup_max, ge=1, description="longest n-gram to match (tried first)")

    @model_validator(mode="after")
    def _ordered(self) -> "SpeculativeArgs":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be at most prompt_lookup_max")
        return self


class LimitsArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_stop_strings: int = Field(LIMITS.max_stop_strings, ge=0)
    max_stop_string_chars: int = Field(LIMITS.max_stop_string_chars, ge=1)
    max_stop_token_ids: int = Field(LIMITS.max_stop_token_ids, ge=0, description="admits a whole-vocabulary stop set")
    max_logprobs: int = Field(LIMITS.max_logprobs, ge=0)
    max_body_bytes: int = Field(LIMITS.max_body_bytes, ge=1024, description="admits a ~1 MB whole-vocabulary stop set")
    max_prompt_tokens: int | None = Field(LIMITS.max_prompt_tokens, ge=1, description="None: only the context limits prompts")
    max_tokens: int | None = Field(LIMITS.max_tokens, ge=1, description="cap on max_tokens; None: only the context")
    max_request_tokens: int | None = Field(
        LIMITS.max_request_tokens, ge=1, description="work one request may ask: its choices (prompts times n) times "
        "prompt and max_tokens, in tokens; past it a 400 naming n. None: no cap")
    max_echo_bytes: int = Field(
        LIMITS.max_echo_bytes, ge=0, description="echo: the prompt's text times the choices it is shown in, in bytes; "
        "past it a 400 naming echo")
    trust_request_chat_template: bool = Field(
        LIMITS.trust_request_chat_template, description="render a chat request's own `chat_template` (in transformers' sandbox), as vLLM's "
        "--trust-request-chat-template; otherwise such a request is a 400")
    refuse_unknown_fields: bool = Field(
        LIMITS.refuse_unknown_fields, description="a request field the API does not know is a 400 naming it, as "
        "OpenAI's; off: it is logged and left out, as vLLM does, for clients that send vendor extras")


class AppArgs(BaseModel):
    """`serve run configs/cluster.yaml` passes these to `pegaserve.deployments.app:build_app`."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(DEFAULT_MODEL_NAME, description="qwen3-tiny (built locally) or a local HF model directory")
    mode: Literal["pd", "colocated"] = Field("pd", description="prefill/decode disaggregated, or one engine")
    transport: str = Field(
        DEFAULT_TRANSPORT, description=f"how KV moves from prefill to decode: {describe_transports()} "
        "(a registered KV transport, pegaserve.pd.transports.registry)")
    push_kv: bool = Field(
        True, description="where the transport pushes: a prefill replica paired with one decode replica sends each "
        "prompt's KV as it leases it, before decode asks (pegaserve/pd/push.py); off: decode fetches it")
    transfer_timeout_s: float = Field(30.0, gt=0, description="a KV transfer that takes longer fails")
    lease_timeout_s: float = Field(ENGINE.lease_timeout_s, ge=0, description="prefill frees a prompt's unfetched KV after this")
    stream_interval: int = Field(
        1, ge=1, description="tokens per message from decode to the ingress and per SSE chunk (the first "
        "token and the finish are never held); more trades streaming granularity for throughput"
    )
    ledger_max_records: int = Field(10_000, ge=1)
    max_stored_bytes: int = Field(
        MAX_STORED_BYTES, ge=1 << 20, description="the stored responses and chat completions, at most this many bytes "
        "of JSON; the oldest go first, a background response still running never")
    max_stored_responses: int = Field(
        MAX_STORED_RESPONSES, ge=1, description="the Responses API's stored responses (store: true) kept, the most recent")
    ledger_orphan_timeout_s: float = Field(
        30.0, ge=1, description="an ingress replica silent this long has died: its open records end as errors")
    ledger_journal: str | None = Field(
        "/tmp/pegaserve/ledger.jsonl", description="append-only journal of finished records; None: memory only"
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description="when non-empty, every route but /health needs `Authorization: Bearer <key>`; "
        f"{API_KEYS_ENV} (comma-separated) adds keys without writing them into the YAML",
    )
    admin_api_keys: list[str] = Field(
        default_factory=list,
        description="when non-empty, /admin needs one of these (and api_keys no longer open it); "
        f"{ADMIN_API_KEYS_ENV} (comma-separated) adds keys without writing them into the YAML")
    allowed_hosts: list[str] = Field(
        default_factory=lambda: list(LOOPBACK_HOSTS),
        description="without api_keys, the Host names served (a request naming another is a 400, so that a web "
        "page cannot reach the server through a DNS name rebound to this machine); '*' serves any")
    max_inflight_requests: int | None = Field(512, ge=1, description="per ingress replica, before 429")
    max_migrations: int = Field(
        2, ge=0, description="times a request resumes on another decode replica after its replica died")
    engine: EngineArgs = EngineArgs()
    speculative: SpeculativeArgs | None = Field(None, description="speculative decoding (off by default)")
    limits: LimitsArgs = LimitsArgs()

    @field_validator("model")
    @classmethod
    def _model_exists(cls, model: str) -> str:
        try:
            ensure_model_dir(model)
        except (FileNotFoundError, OSError) as exc:
            raise ValueError(str(exc)) from exc
        return model

    @field_validator("transport")
    @classmethod
    def _known_transport(cls, name: str) -> str:
        return check_transport_name(name)

    @model_validator(mode="after")
    def _transport_can_run(self) -> "AppArgs":
        transport_class(self.transport).check(self.engine.device)
        if self.engine.device == "cuda":
            import torch  # noqa: PLC0415

            if not torch.cuda.is_available():
                raise ValueError("engine.device is cuda but this machine has no CUDA device")
        return self

    @property
    def served_name(self) -> str:
        """The model's name on the API and in every metric's `model` tag."""
        return served_name(self.model)

    def all_api_keys(self) -> tuple[str, ...]:
        return _with_env(self.api_keys, API_KEYS_ENV)

    def all_admin_api_keys(self) -> tuple[str, ...]:
        return _with_env(self.admin_api_keys, ADMIN_API_KEYS_ENV)

    def without_keys(self) -> "AppArgs":
        """These arguments with no key in them (what the engine replicas are given)."""
        return self.model_copy(update={"api_keys": [], "admin_api_keys": []})


def _with_env(keys: list[str], env: str) -> tuple[str, ...]:
    extra = [k.strip() for k in os.environ.get(env, "").split(",") if k.strip()]
    return tuple(dict.fromkeys([*keys, *extra]))

