"""The model registry is the one seam a family plugs into: a family registered from a test (one
`register_model` line, no product file touched) loads and generates through `load_engine`; an
architecture nobody registered fails at load with one line naming it and the supported ones."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pegaserve.config import EngineConfig
from pegaserve.engine.build import load_engine
from pegaserve.models import registry
from pegaserve.models.config import ModelConfig
from pegaserve.models.qwen3 import Qwen3ForCausalLM
from pegaserve.models.registry import UnsupportedArchitecture, model_class, register_model
from tests.helpers import greedy_request, run_to_completion, token_ids
from tests.models import toy_family

PROMPTS = [[5, 9, 3], [17], list(range(40, 63)), [100, 2, 100, 2, 7, 7, 7, 1, 90]]
NEW_TOKENS = 8


@pytest.fixture
def toy_registered(monkeypatch):
    """The registry as the product ships it plus the toy family, for this test only."""
    monkeypatch.setattr(registry, "MODEL_ARCHITECTURES", dict(registry.MODEL_ARCHITECTURES))
    register_model(toy_family.ARCHITECTURE, toy_family.TARGET)


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return toy_family.write_checkpoint(tmp_path_factory.mktemp("toy"))


def test_the_tiny_checkpoint_resolves_to_qwen3(tiny_model_dir):
    assert model_class(ModelConfig.from_dir(tiny_model_dir)) is Qwen3ForCausalLM
    assert "Qwen3ForCausalLM" in registry.supported_architectures()


def test_a_family_registered_from_a_test_loads_and_generates(toy_registered, toy_dir):
    engine = load_engine(
        toy_dir, EngineConfig(num_blocks=64, block_size=4, max_num_batched_tokens=16), attention_backend="sdpa"
    )
    model = engine.runner.model
    assert isinstance(model, toy_family.ToyForCausalLM)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(greedy_request(f"r{i}", prompt, NEW_TOKENS))
    outputs = run_to_completion(engine)

    for i, prompt in enumerate(PROMPTS):  # each token, from dense attention over the whole context
        expected = []
        for _ in range(NEW_TOKENS):
            expected.append(int(model.reference_logits(prompt + expected).argmax()))
        assert token_ids(outputs[f"r{i}"]) == expected, f"prompt {i}"


def test_the_loaded_toy_holds_the_checkpoint_weights(toy_registered, toy_dir):
    model = load_engine(toy_dir, EngineConfig(num_blocks=8), attention_backend="sdpa").runner.model
    saved = load_file(str(toy_dir / "model.safetensors"))
    assert set(saved) == set(model.state_dict())
    assert all(torch.equal(saved[name], tensor) for name, tensor in model.state_dict().items())


def test_an_unknown_architecture_fails_at_load_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**toy_family.CONFIG, "architectures": ["MysteryForCausalLM"]}))
    ModelConfig.from_dir(tmp_path)  # the config normalizes; the registry is what refuses
    with pytest.raises(UnsupportedArchitecture) as refused:
        load_engine(tmp_path, EngineConfig(num_blocks=8), attention_backend="sdpa")
    message = str(refused.value)
    assert "\n" not in message
    assert "'MysteryForCausalLM'" in message and "supported: Qwen3ForCausalLM" in message


def test_a_config_naming_no_architecture_fails_the_same_way(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in toy_family.CONFIG.items() if k != "architectures"})
    )
    with pytest.raises(UnsupportedArchitecture, match="names no architecture.*supported: Qwen3ForCausalLM"):
        load_engine(tmp_path, EngineConfig(num_blocks=8), attention_backend="sdpa")


def test_a_registration_names_a_module_and_a_class(monkeypatch):
    monkeypatch.setattr(registry, "MODEL_ARCHITECTURES", dict(registry.MODEL_ARCHITECTURES))
    with pytest.raises(ValueError, match="not 'package.module:Class'"):
        register_model("ToyForCausalLM", "tests.models.toy_family.ToyForCausalLM")
