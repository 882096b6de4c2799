"""The typed stop causes and the token-level stop policy of docs/contract.md (rules 1-7).

A `StopCause` is decided once, by the component that sees the trigger, and travels typed to the
ledger and to the wire; nothing downstream re-derives it by comparing reason names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias


@dataclass(frozen=True)
class Eos:
    """A model EOS id was generated while `ignore_eos` was false."""

    token_id: int


@dataclass(frozen=True)
class Token:
    """An explicit `stop_token_ids` match."""

    token_id: int


@dataclass(frozen=True)
class String:
    """A stop string matched in the generated text (decided by the ingress)."""

    text: str


@dataclass(frozen=True)
class Length:
    """`max_tokens` reached or the context is full."""


@dataclass(frozen=True)
class Abort:
    """The client went away or the request was cancelled; no finishing chunk is sent."""


@dataclass(frozen=True)
class Error:
    """The server failed the request."""

    message: str


StopCause: TypeAlias = Eos | Token | String | Length | Abort | Error
CauseKind: TypeAlias = Literal["eos", "token", "string", "length", "abort", "error"]
FinishReason: TypeAlias = Literal["stop", "length"]

_KINDS: dict[type, CauseKind] = {
    Eos: "eos",
    Token: "token",
    String: "string",
    Length: "length",
    Abort: "abort",
    Error: "error",
}


def cause_kind(cause: StopCause) -> CauseKind:
    return _KINDS[type(cause)]


def finish_reason(cause: StopCause) -> FinishReason | None:
    """The OpenAI `finish_reason`; None for causes that send no finishing chunk."""
    match cause:
        case Eos() | Token() | String():
            return "stop"
        case Length():
            return "length"
        case _:
            return None


def stop_reason(cause: StopCause) -> int | str | None:
    """vLLM's `stop_reason`: the stop id or string that matched; None for EOS and length."""
    match cause:
        case Token(token_id):
            return token_id
        case String(text):
            return text
        case _:
            return None


def triggering_token(cause: StopCause | None) -> int | None:
    """The token whose classification ended the request, for token-level causes."""
    match cause:
        case Eos(token_id) | Token(token_id):
            return token_id
        case _:
            return None


@dataclass(frozen=True)
class StopPolicy:
    """Token-level stop rules for one request. Built once by the ingress; engines only read it.

    `eos_token_ids` are the model's EOS ids (tokenizer EOS ∪ generation_config eos_token_id).
    `max_tokens=0` generates nothing: the prompt is only scored (completions with `echo`).
    """

    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        assert self.max_tokens >= 0, "validated at the API edge"
        assert 0 <= self.min_tokens <= self.max_tokens, "validated at the API edge"

    def classify(self, token_id: int, num_tokens: int) -> StopCause | None:
        """Classify the `num_tokens`-th generated token (1-based): rule 2's order of checks.

        (a) while the `min_tokens` gate is closed no EOS or stop id can end the request (they were
        masked out of sampling, rule 6); (b) model EOS unless `ignore_eos` (rules 3, 4);
        (c) `stop_token_ids`; (d) length — a stop on the `max_tokens`-th token wins (rule 5).
        """
        if num_tokens > self.min_tokens:
            if not self.ignore_eos and token_id in self.eos_token_ids:
                return Eos(token_id)
            if token_id in self.stop_token_ids:
                return Token(token_id)
        if num_tokens >= self.max_tokens:
            return Length()
        return None

    def masked_token_ids(self, num_tokens: int) -> frozenset[int]:
        """Ids to mask out of sampling for the next token when `num_tokens` already exist (rule 6)."""
        if num_tokens >= self.min_tokens:
            return frozenset()
        eos = frozenset() if self.ignore_eos else self.eos_token_ids
        return eos | self.stop_token_ids
