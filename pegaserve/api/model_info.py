"""What the API knows of the served model, normalized once from its `ModelConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pegaserve.models.config import ModelConfig
from pegaserve.models.tiny import DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class ModelInfo:
    """What validation needs to know about the served model."""

    name: str
    root: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]


def model_info(name: str, config: ModelConfig, max_model_len: int | None) -> ModelInfo:
    """`max_model_len=None` serves the model's own context. The EOS ids and the context length are
    the engine's own (`ModelConfig`), so the API and the engine never disagree about them."""
    return ModelInfo(
        name=name,
        root=str(config.model_dir),
        max_model_len=config.context_len(max_model_len),
        vocab_size=config.vocab_size,
        eos_token_ids=config.eos_token_ids,
    )


def served_name(model: str) -> str:
    """The name clients use: `qwen3-tiny`, or a model directory's last component."""
    return DEFAULT_MODEL_NAME if model == DEFAULT_MODEL_NAME else Path(model).name
