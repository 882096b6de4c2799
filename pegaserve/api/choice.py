"""One choice's string-level and text rules (docs/contract.md 8-18): the frontend's obligations.

A `ChoiceStream` turns one choice's engine messages into client-facing deltas: it detokenizes
incrementally, finds stop strings (earliest end wins), cuts text and tokens at the match, holds back
only what could still become an excluded stop string, and emits each token exactly once. The engine
decides a token's finish in the message that carries the token, so a trigger is released together
with its finish (rule 18).
"""

from __future__ import annotations

from dataclasses import dataclass

from pegaserve.messages import SampledToken, StepOutput, TokenScore, add_counts
from pegaserve.stop import Eos, StopCause, String, Token
from pegaserve.tokenizer import Detokenizer


@dataclass(frozen=True)
class StopStrings:
    strings: tuple[str, ...] = ()
    include_in_output: bool = False

    def earliest_match(self, text: str, min_end: int) -> tuple[str, int, int] | None:
        """The match ending first at or after `min_end` (ties: list order) as (string, start, end)."""
        best: tuple[str, int, int] | None = None
        for s in self.strings:
            start = text.find(s, max(0, min_end - len(s)))
            if start >= 0 and (best is None or start + len(s) < best[2]):
                best = (s, start, start + len(s))
        return best

    def holdback(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of an excluded stop string."""
        if self.include_in_output:
            return 0
        longest = 0
        for s in self.strings:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest


@dataclass(frozen=True)
class ChoiceDelta:
    """What the client gets next: text, the tokens released with it, and the finish if this is the
    finishing delta (with `finish` set, every kept token has been released). A choice's first delta
    carries the prompt's scores when the request asked the engine for them, and how many of the
    prompt's tokens the prefix cache held, where the engine said; any delta, the predicted-output
    drafts accepted and rejected since the one before (`StepOutput.prediction_tokens`)."""

    text: str
    tokens: tuple[SampledToken, ...]
    finish: StopCause | None = None
    prompt_logprobs: tuple[TokenScore | None, ...] | None = None
    num_cached_tokens: int | None = None
    prediction_tokens: tuple[int, int] = (0, 0)


class ChoiceStream:
    def __init__(self, detokenizer: Detokenizer, stops: StopStrings, min_tokens: int = 0) -> None:
        self._detokenizer = detokenizer
        self._stops = stops
        self._min_tokens = min_tokens
        self._text = ""
        self._tokens: list[tuple[SampledToken, int]] = []  # (token, text length after it)
        self._num_released_chars = 0
        self._num_released_tokens = 0
        self._gate: int | None = 0 if min_tokens == 0 else None  # where stop-string matches may end
        self._prompt_logprobs: tuple[TokenScore | None, ...] | None = None
        self._num_cached_tokens: int | None = None
        self._prediction_tokens = (0, 0)  # since the last delta
        self._started = False  # whether a delta was released
        self.finish: StopCause | None = None

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t, _ in self._tokens]

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def feed(self, output: StepOutput) -> ChoiceDelta | None:
        """Take one engine message; return the delta to send, or None when nothing is new."""
        assert self.finish is None, "no message after the finish"
        if output.prompt_logprobs is not None and self._prompt_logprobs is None:
            self._prompt_logprobs = output.prompt_logprobs
        if self._num_cached_tokens is None:
            self._num_cached_tokens = output.num_cached_tokens
        self._prediction_tokens = add_counts(self._prediction_tokens, output.prediction_tokens)
        tokens = output.tokens
        for i, token in enumerate(tokens):
            self._add(token, output.finish if i == len(tokens) - 1 else None)
            if self.finish is not None:
                break
        if self.finish is None and output.finish is not None:
            self.finish = output.finish  # abort/error, or a finish without tokens
        return self._release()

    def _add(self, token: SampledToken, cause: StopCause | None) -> None:
        excluded_trigger = isinstance(cause, Eos | Token) and not self._stops.include_in_output
        piece = "" if excluded_trigger else self._detokenizer.step(token.token_id)  # rule 12
        old_len = len(self._text)
        self._text += piece
        self._tokens.append((token, len(self._text)))
        if len(self._tokens) == self._min_tokens:
            self._gate = len(self._text)
        if isinstance(cause, Eos | Token):
            self.finish = cause  # the engine decided at the token level
            return
        if self._stops.strings and self._gate is not None and piece:
            match = self._stops.earliest_match(self._text, min_end=max(old_len, self._gate) + 1)
            if match is not None:  # rules 9-10: earliest end wins; cut text, keep this token last
                s, start, end = match
                self._text = self._text[: end if self._stops.include_in_output else start]
                self.finish = String(s)
                return
        self.finish = cause

    def _release(self) -> ChoiceDelta | None:
        if self.finish is not None:
            releasable = len(self._text)
            num_tokens = len(self._tokens)
        else:
            releasable = len(self._text) - self._stops.holdback(self._text)
            releasable = max(releasable, self._num_released_chars)
            num_tokens = self._num_released_tokens
            while num_tokens < len(self._tokens) and self._tokens[num_tokens][1] <= releasable:
                num_tokens += 1
        text = self._text[self._num_released_chars : releasable]
        tokens = tuple(t for t, _ in self._tokens[self._num_released_tokens : num_tokens])
        self._num_released_chars, self._num_released_tokens = releasable, num_tokens
        if not text and not tokens and self.finish is None:
            return None
        first, self._started = not self._started, True
        prediction, self._prediction_tokens = self._prediction_tokens, (0, 0)
        return ChoiceDelta(text, tokens, self.finish, self._prompt_logprobs if first else None,
                           self._num_cached_tokens if first else None, prediction)
