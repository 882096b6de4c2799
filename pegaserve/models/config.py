"""The model's shape, normalized once from a Hugging Face model directory.

Every family reads this one normalized config; which families exist is the registry's business
(`pegaserve.models.registry`), so a config of any architecture normalizes here and an unknown one
is refused where the model is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from pegaserve.models.layers import ROPE_INV_FREQ


class ModelLoadError(ValueError):
    """The model directory cannot be served; the message names the path and what is wrong."""


@dataclass(frozen=True)
class ModelConfig:
    model_dir: Path
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    dtype: torch.dtype
    architecture: str | None = None  # config.json's `architectures[0]` (the registry's key); None: it names none
    rope_type: str = "default"  # a key of `layers.ROPE_INV_FREQ`

    @classmethod
    def from_dir(cls, model_dir: str | Path, dtype: torch.dtype | None = None) -> "ModelConfig":
        model_dir = Path(model_dir)
        config_path = model_dir / "config.json"
        if not config_path.is_file():
            raise ModelLoadError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
        hf = json.loads(config_path.read_text())
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ROPE_INV_FREQ:
            raise ModelLoadError(f"{model_dir}: rope type {rope_type!r} is not supported ({', '.join(ROPE_INV_FREQ)})")
        num_heads = hf["num_attention_heads"]
        return cls(
            model_dir=model_dir,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            eos_token_ids=_eos_token_ids(model_dir, hf),
            dtype=dtype or _dtype(hf),
            architecture=(hf.get("architectures") or [None])[0],
            rope_type=rope_type,
        )

    def context_len(self, requested: int | None) -> int:
        """The context length to serve: `requested` (None: the model's own), never past the model's."""
        return min(requested or self.max_position_embeddings, self.max_position_embeddings)


def _as_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


def _eos_token_ids(model_dir: Path, hf: dict) -> frozenset[int]:
    """Tokenizer EOS ∪ generation_config eos_token_id ∪ config eos_token_id (docs/CONTRACT.md causes)."""
    ids = _as_set(hf.get("eos_token_id"))
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        ids |= _as_set(json.loads(gen_path.read_text()).get("eos_token_id"))
    tokenizer_eos = _tokenizer_eos_id(model_dir)
    if tokenizer_eos is not None:
        ids.add(tokenizer_eos)
    return frozenset(ids)


def _tokenizer_eos_id(model_dir: Path) -> int | None:
    """The id of tokenizer_config.json's `eos_token`, looked up in tokenizer.json's vocabulary."""
    config_path, tokenizer_path = model_dir / "tokenizer_config.json", model_dir / "tokenizer.json"
    if not config_path.is_file() or not tokenizer_path.is_file():
        return None
    eos = json.loads(config_path.read_text()).get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    if not isinstance(eos, str):
        return None
    text = tokenizer_path.read_text()
    key = text.find('"added_tokens"')  # decode just that list: the whole file is megabytes of vocabulary
    if key >= 0:
        added, _ = json.JSONDecoder().raw_decode(text, text.index("[", key))
        for token in added:
            if token.get("content") == eos:
                return token["id"]
    return json.loads(text).get("model", {}).get("vocab", {}).get(eos)


def _dtype(hf: dict) -> torch.dtype:
    name = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ModelLoadError(f"unknown dtype {name!r} in config.json")
    return dtype
