"""Assemble an engine from a model directory."""

from __future__ import annotations

from pathlib import Path

import torch

from pegaserve.attention.registry import AUTO, make_backend
from pegaserve.config import EngineConfig
from pegaserve.engine.core import EngineCore
from pegaserve.models.config import ModelConfig
from pegaserve.models.loader import load_model


def load_engine(
    model_dir: str | Path,
    config: EngineConfig = EngineConfig(),
    attention_backend: str = AUTO,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
) -> EngineCore:
    """The family the checkpoint's config.json names (`pegaserve.models.registry`), attending through
    the backend named `attention_backend` (`pegaserve.attention.registry`). `dtype=None` serves
    the checkpoint's dtype on CUDA and float32 on CPU."""
    if dtype is None and device == "cpu":
        dtype = torch.float32
    cfg = ModelConfig.from_dir(model_dir, dtype=dtype)
    model = load_model(cfg, make_backend(attention_backend), device)
    return EngineCore(model, config, device)
