"""Model families by architecture: the `architectures[0]` of a checkpoint's config.json names the
class that implements it, as a `"module:Class"` string imported on first use (as vLLM's
`_TEXT_GENERATION_MODELS`).

Adding a family: a module under pegaserve/models/ whose class is a `CausalLM` (built from shared
`layers`), one line in `MODEL_ARCHITECTURES`, and a test against transformers' own class.
"""

from __future__ import annotations

import pkgutil
from typing import Protocol

import torch

from pegaserve.attention.backend import AttentionBackend, AttentionBatch
from pegaserve.models.config import ModelConfig, ModelLoadError

MODEL_ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "pegaserve.models.qwen3:Qwen3ForCausalLM",
}


class UnsupportedArchitecture(ModelLoadError):
    """No family is registered for the checkpoint's architecture; the message names it and the
    supported ones."""


class CausalLM(Protocol):
    """What the engine needs of a family's class (an `nn.Module`).

    Built on the meta device from the normalized config and the engine's attention backend, its
    state dict named as the checkpoint's tensors (the loader assigns them by name; a parameter
    shared by two names, as tied embeddings are, is read once). It may also offer
    `screened_head()` (`Qwen3ForCausalLM`'s), which the runner uses where present.
    """

    config: ModelConfig

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None: ...

    def __call__(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        batch: AttentionBatch,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """Write the step's K/V into each layer's cache and return the last hidden states."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab] fp32
        """The LM head over the rows the caller picked."""


def register_model(architecture: str, target: str) -> None:
    """Register `target` (`"package.module:Class"`, a `CausalLM`) for checkpoints whose config.json
    names `architecture`; the module is imported when such a checkpoint is loaded."""
    if target.count(":") != 1:
        raise ValueError(f"architecture {architecture!r}: target {target!r} is not 'package.module:Class'")
    MODEL_ARCHITECTURES[architecture] = target


def supported_architectures() -> tuple[str, ...]:
    return tuple(MODEL_ARCHITECTURES)


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    """The class registered for `cfg.architecture`, its module imported now; `UnsupportedArchitecture`
    (one line, naming it and the supported ones) if there is none."""
    target = MODEL_ARCHITECTURES.get(cfg.architecture) if cfg.architecture is not None else None
    if target is None:
        named = f"architecture {cfg.architecture!r}" if cfg.architecture is not None else "no architecture"
        raise UnsupportedArchitecture(
            f"{cfg.model_dir}: config.json names {named}, which is not supported "
            f"(supported: {', '.join(supported_architectures())})"
        )
    return pkgutil.resolve_name(target)
