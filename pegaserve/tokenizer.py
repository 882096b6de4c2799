"""The model's tokenizer: encoding, the chat template, and incremental UTF-8-safe decoding.

Encoding and the chat template come from transformers' fast tokenizer; incremental decoding uses
`tokenizers`' `DecodeStream`, which holds a partial UTF-8 character until it completes
(docs/contract.md rule 14).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        self.hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        self.backend = self.hf.backend_tokenizer
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
        self.special_ids = frozenset(self.hf.all_special_ids) | frozenset(
            token_id for token_id, token in self.hf.added_tokens_decoder.items() if token.special
        )

    @property
    def eos_token_id(self) -> int | None:
        return self.hf.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def detokenizer(self, skip_special_tokens: bool = True) -> "Detokenizer":
        return Detokenizer(self, skip_special_tokens)


class Detokenizer:
    """Turns generated ids into text pieces, one per token; a piece is "" while a character is
    still incomplete, and the token that completes it carries the whole character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        return self._stream.step(self._tokenizer.backend, token_id) or ""
