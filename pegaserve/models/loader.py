"""Load a Hugging Face checkpoint directory (bf16 or fp32 safetensors, sharded or not) into the
family its config.json names (`pegaserve.models.registry`). The model keeps the checkpoint's
parameter names, so loading is a name mapping: each tensor to the parameter of its name."""

from __future__ import annotations

import torch
from safetensors import safe_open
from torch import nn

from pegaserve.attention.backend import AttentionBackend
from pegaserve.models.config import ModelConfig, ModelLoadError
from pegaserve.models.registry import model_class


def load_model(cfg: ModelConfig, backend: AttentionBackend, device: str = "cpu") -> nn.Module:
    """Build the module on the meta device (no wasted init), then assign the checkpoint's tensors."""
    family = model_class(cfg)
    files = sorted(cfg.model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{cfg.model_dir}: no *.safetensors weights")
    with torch.device("meta"):
        model = family(cfg, backend)
    aliases = tied_names(model)  # e.g. lm_head.weight -> model.embed_tokens.weight with tied embeddings
    expected = set(model.state_dict()) - set(aliases)
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in expected:
                    continue  # e.g. a tied checkpoint that still ships lm_head, or rotary buffers
                state[name] = f.get_tensor(name).to(device=device, dtype=cfg.dtype)
    missing = sorted(expected - set(state))
    if missing:
        raise ModelLoadError(f"{cfg.model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    for alias, name in aliases.items():  # assigning replaced the shared parameter under one name only
        owner, _, attribute = alias.rpartition(".")
        setattr(model.get_submodule(owner), attribute, model.get_parameter(name))
    return model.to(device).eval()  # buffers built at construction (rotary tables) join the weights


def tied_names(model: nn.Module) -> dict[str, str]:
    """Each parameter name that shares its parameter with an earlier one -> that earlier name."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases
