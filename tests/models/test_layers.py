"""The shared layers and the loader's generic parts: rotary tables that survive a meta-device build,
a rope type no layer implements refused as the config is read, tied parameters found by sharing."""

from __future__ import annotations

import json

import pytest
import torch

from pegaserve.attention.backend import SdpaBackend
from pegaserve.models.config import ModelConfig, ModelLoadError
from pegaserve.models.layers import Rotary
from pegaserve.models.loader import tied_names
from pegaserve.models.qwen3 import Qwen3ForCausalLM
from tests.models import toy_family


def test_rotary_tables_are_built_on_the_cpu_even_on_the_meta_device():
    with torch.device("meta"):
        meta_built = Rotary(64, 1e6, 32)
    plain = Rotary(64, 1e6, 32)
    assert meta_built.cos.device.type == "cpu"
    assert torch.equal(meta_built.cos, plain.cos) and torch.equal(meta_built.sin, plain.sin)


def test_an_unsupported_rope_type_is_refused_in_one_line(tmp_path):
    scaled = {**toy_family.CONFIG, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(scaled))
    with pytest.raises(ModelLoadError, match=r"rope type 'yarn' is not supported \(default\)$"):
        ModelConfig.from_dir(tmp_path)


def test_tied_embeddings_are_found_by_sharing(tiny_model_dir):
    cfg = ModelConfig.from_dir(tiny_model_dir)
    assert cfg.tie_word_embeddings
    with torch.device("meta"):
        model = Qwen3ForCausalLM(cfg, SdpaBackend())
    assert tied_names(model) == {"lm_head.weight": "model.embed_tokens.weight"}
