"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a regex, a choice of
strings or an EBNF grammar) as a mask of the tokens that keep its output inside it, by xgrammar.

A request's `Constraint` is a matcher that has read the request's output so far: it is made the
first time the request samples on an engine (a prefill, a decode after its handoff, a resume
elsewhere) and reads whatever output the request already has, so every role masks alike without
anything but token ids crossing between them. The grammar ends only at one of the model's EOS
tokens, which it allows only once the output is complete.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from collections.abc import Callable

    from pegaserve.models.config import ModelConfig

log = logging.getLogger(__name__)
KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match. `text`: the JSON schema (as JSON), the regex, the choices
    (a JSON list of strings) or the EBNF grammar; empty for `json_object`."""

    kind: str
    text: str = ""
    any_whitespace: bool = True  # JSON: any whitespace between its tokens (False: compact, `", "` and `": "`)

    def check(self) -> None:
        """Raises ValueError, with xgrammar's reason and nothing of its internals, if it is not one."""
        import xgrammar  # noqa: PLC0415 - only structured outputs need it

        try:
            as_xgrammar(xgrammar, self)
        except (RuntimeError, ValueError) as exc:
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ValueError(re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", message)) from None


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices` (vLLM's guided_choice)."""
    return "(" + "|".join(re.escape(c) for c in choices) + ")"


def as_xgrammar(xgrammar, grammar: GrammarSpec):
    """`grammar` as xgrammar's `Grammar` (`xgrammar`: the module, imported by the caller, as only
    structured outputs need it); raises ValueError for an unknown kind."""
    if grammar.kind in ("json_schema", "json_object"):  # json_object: an object, as OpenAI's JSON mode gives
        return xgrammar.Grammar.from_json_schema(grammar.text if grammar.kind == "json_schema" else '{"type": "object"}',
                                                 any_whitespace=grammar.any_whitespace)
    if grammar.kind == "regex":
        return xgrammar.Grammar.from_regex(grammar.text)
    if grammar.kind == "choice":
        return xgrammar.Grammar.from_regex(choice_regex(json.loads(grammar.text)))
    if grammar.kind == "ebnf":
        return xgrammar.Grammar.from_ebnf(grammar.text)
    raise ValueError(f"unknown kind of grammar {grammar.kind!r} (one of {', '.join(KINDS)})")


class Grammars:
    """One engine's compiler, built from the model's tokenizer (~1 s) by `warm_up` or on first use,
    and the grammars it compiled."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self._compiler = None
        self._compiled: dict[GrammarSpec, object] = {}
        self._lock = threading.Lock()

    def warm_up(self, then: Callable[[], None] | None = None) -> threading.Thread:
        """Build the compiler on a thread of its own now, so that the first request with a grammar
        does not hold up a step for it (a serving engine calls this as it starts), then call `then`."""

        def build() -> None:
            try:
                import xgrammar  # noqa: PLC0415

                with self._lock:
                    self._compiler_of(xgrammar)
            except Exception:  # the first request with a grammar tries again, and fails with the reason
                log.exception("could not build the grammar compiler")
            if then is not None:
                then()

        thread = threading.Thread(target=build, name="grammar-compiler", daemon=True)
        thread.start()
        return thread

    def constraint(self, grammar: GrammarSpec) -> Constraint:
        import xgrammar  # noqa: PLC0415 - only structured outputs need it

        config = self.model_config
        try:
            with self._lock:
                compiled = self._compiled.get(grammar)
                if compiled is None:
                    compiler = self._compiler_of(xgrammar)
                    compiled = self._compiled[grammar] = compiler.compile_grammar(as_xgrammar(xgrammar, grammar))
        except Exception:  # the ingress read it already (GrammarSpec.check): never the engine loop's end
            log.exception("could not compile a request's grammar; the request may only end")
            return Constraint(None, config.vocab_size, config.eos_token_ids)
        return Constraint(xgrammar.GrammarMatcher(compiled), config.vocab_size, config.eos_token_ids)

    def _compiler_of(self, xgrammar):
        if self._compiler is None:
            from transformers import AutoTokenizer  # noqa: PLC0415

            config = self.model_config
            tokenizer = AutoTokenizer.from_pretrained(config.model_dir)
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=config.vocab_size,
                                                           stop_token_ids=sorted(config.eos_token_ids))
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return self._compiler


class Constraint:
    """A request's matcher and how much of its output it has read."""

    def __init__(self, matcher, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.matcher = matcher  # None: its grammar would not compile
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.num_read = 0
        self.broken = matcher is None

    def bitmask(self, output_token_ids: tuple[int, ...]) -> torch.Tensor:
        """The tokens allowed after `output_token_ids` (the request's output, of which the first
        `num_read` were read before), one bit each, xgrammar's layout: int32 words, token t is bit
        t % 32 of word t // 32."""
        for token_id in output_token_ids[self.num_read :]:
            if not self.broken and not self.matcher.accept_token(token_id):
                # only a sampler bug could get here: what is left of the request may only end it
                log.error("token %d is outside its request's grammar; only EOS is allowed from here", token_id)
                self.broken = True
        self.num_read = len(output_token_ids)
        words = torch.zeros(-(-self.vocab_size // 32), dtype=torch.int32)
        if self.broken or self.matcher.is_terminated():
            for token_id in self.eos_token_ids:
                bit = token_id % 32
                words[token_id // 32] |= (1 << bit) if bit < 31 else -(1 << 31)  # int32's sign bit
            return words
        self.matcher.fill_next_token_bitmask(words[None])
        return words


def allowed_by(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bitmask as one bool per token of a `vocab_size` vocabulary."""
    bits = (bitmask[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab_size].bool()
