"""The attention registry is the one seam a backend plugs into: a backend registered from a test
(one `register_backend` line) is selected by name and gives the default's greedy tokens; `auto`
picks what it always picked; a backend refuses, as the model is built, what it cannot compute."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from pegaserve.attention import registry
from pegaserve.attention.backend import AttentionBackend, AttentionSpec, SdpaBackend, UnsupportedAttention
from pegaserve.attention.registry import UnknownAttentionBackend, backend_names, make_backend, register_backend
from pegaserve.config import EngineConfig
from pegaserve.engine.build import load_engine
from pegaserve.models.layers import PagedAttention
from tests.helpers import PROMPTS, greedy_request, run_to_completion, token_ids

NEW_TOKENS = 6
KERNELS_DIR = Path(__file__).resolve().parents[2] / "kernels" / "triton"


class ForwardingBackend(AttentionBackend):
    """Forwards every call to the torch backend, counting them."""

    name = "forwarding"

    def __init__(self) -> None:
        self.inner = SdpaBackend()
        self.num_calls = 0

    def forward(self, q, k, v, kv_layer, batch, spec):
        self.num_calls += 1
        return self.inner.forward(q, k, v, kv_layer, batch, spec)


@pytest.fixture
def backends(monkeypatch):
    """The registry as the product ships it, changed for this test only."""
    monkeypatch.setattr(registry, "ATTENTION_BACKENDS", dict(registry.ATTENTION_BACKENDS))


def greedy_tokens(engine) -> list[list[int]]:
    prompts = PROMPTS[:4]
    for i, prompt in enumerate(prompts):
        engine.add_request(greedy_request(f"r{i}", prompt, NEW_TOKENS))
    outputs = run_to_completion(engine)
    return [token_ids(outputs[f"r{i}"]) for i in range(len(prompts))]


def test_a_backend_registered_from_a_test_is_selected_by_name(backends, tiny_model_dir):
    register_backend("forwarding", f"{__name__}:ForwardingBackend")
    assert "forwarding" in backend_names()
    config = EngineConfig(num_blocks=64, block_size=8)
    engine = load_engine(tiny_model_dir, config, attention_backend="forwarding")
    expected = greedy_tokens(load_engine(tiny_model_dir, config))  # the default backend

    assert greedy_tokens(engine) == expected
    layers = [m.attn for m in engine.runner.model.modules() if isinstance(getattr(m, "attn", None), PagedAttention)]
    assert layers and all(type(layer.backend) is ForwardingBackend for layer in layers)
    assert layers[0].backend.num_calls > 0


def test_names_select_their_class_and_auto_picks_as_before(backends, monkeypatch):
    assert type(make_backend("sdpa")) is SdpaBackend
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert type(make_backend("auto")) is SdpaBackend  # triton is not even imported without CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    registry.ATTENTION_BACKENDS["triton"] = "pegaserve_no_such_module:TritonBackend"
    assert type(make_backend("auto")) is SdpaBackend  # CUDA without a working triton: the torch path
    with pytest.raises(ImportError):
        make_backend("triton")  # asked for by name: its import error, not a silent fallback


def test_an_unknown_name_is_refused_naming_the_known_ones():
    with pytest.raises(
        UnknownAttentionBackend, match="unknown attention backend 'flash': expected one of auto, sdpa, triton"
    ):
        make_backend("flash")
    with pytest.raises(ValueError):
        register_backend("auto", f"{__name__}:ForwardingBackend")


def test_what_a_backend_cannot_compute_is_refused_as_the_model_is_built():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
    PagedAttention(SdpaBackend(), spec)
    with pytest.raises(UnsupportedAttention, match="'sdpa' does not support a sliding window"):
        PagedAttention(SdpaBackend(), AttentionSpec(4, 2, 16, 0.25, sliding_window=512))
    with pytest.raises(UnsupportedAttention, match="'sdpa' does not support a logit soft-cap"):
        PagedAttention(SdpaBackend(), AttentionSpec(4, 2, 16, 0.25, logit_soft_cap=50.0))


@pytest.mark.parametrize("path", sorted(KERNELS_DIR.glob("*.py")), ids=lambda p: p.name)
def test_kernels_never_import_the_attention_package(path):
    """pegaserve.attention imports pegaserve.kernels (the triton backend), never the other way."""
    imported = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert not {name for name in imported if name.startswith("pegaserve.attention")}
