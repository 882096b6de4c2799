"""Fixtures the API tests share: one standalone server on qwen3-tiny's real weights, and
transformers' Qwen3ForCausalLM on the same weights as the reference."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM

from pegaserve.api.app import build_app
from tests.api.helpers import real_frontend
from tests.contract.server import ThreadedServer


@pytest.fixture(scope="session")
def real_server(tiny_model_dir):
    with ThreadedServer(build_app(real_frontend())) as running:
        yield running


@pytest.fixture(scope="session")
def hf(tiny_model_dir):
    return Qwen3ForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
