"""Load a Hugging Face Qwen3 checkpoint directory (bf16 or fp32 safetensors, sharded or not)."""

from __future__ import annotations

import torch
from safetensors import safe_open

from pegaserve.attention.backend import AttentionBackend
from pegaserve.models.config import ModelConfig, ModelLoadError
from pegaserve.models.qwen3 import Qwen3ForCausalLM


def load_model(cfg: ModelConfig, backend: AttentionBackend, device: str = "cpu") -> Qwen3ForCausalLM:
    """Build the module on the meta device (no wasted init), then assign the checkpoint's tensors."""
    files = sorted(cfg.model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{cfg.model_dir}: no *.safetensors weights")
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, backend)
    expected = set(model.state_dict())
    state: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name not in expected:
                    continue  # e.g. a tied checkpoint that still ships lm_head, or rotary buffers
                state[name] = f.get_tensor(name).to(device=device, dtype=cfg.dtype)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.discard("lm_head.weight")
    missing = sorted(expected - set(state))
    if missing:
        raise ModelLoadError(f"{cfg.model_dir}: checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    rotary = model.model.layers[0].self_attn.rotary
    fresh = type(rotary)(cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings)
    rotary.cos, rotary.sin = fresh.cos.to(device), fresh.sin.to(device)  # buffers were meta
    return model.eval()
