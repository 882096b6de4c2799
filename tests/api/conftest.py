"""Fixtures the API tests share: one standalone server on qwen3-tiny's real weights, one on a
scripted model, and transformers' Qwen3ForCausalLM on the real weights as the reference."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM

from pegaserve.api.app import build_app
from tests.api.helpers import PROMPT, real_frontend, scripted_frontend
from tests.contract.server import ThreadedServer


@pytest.fixture(scope="session")
def real_server(tiny_model_dir):
    with ThreadedServer(build_app(real_frontend())) as running:
        yield running


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """A server whose model follows a script: "a", " b", " c" after PROMPT (the runner-up "b" where
    the script's token is masked), "a" after anything else (pegaserve.testing.scripted)."""
    with ThreadedServer(build_app(scripted_frontend(tiny_model_dir, {tuple(PROMPT): (64, 293, 272)}))) as running:
        yield running


@pytest.fixture(scope="session")
def hf(tiny_model_dir):
    return Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
