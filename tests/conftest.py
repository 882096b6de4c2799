"""Shared fixtures: the default model is built once per machine (models/ is git-ignored)."""

from __future__ import annotations

import pytest

from pegaserve.default_model import build_default_model


@pytest.fixture(scope="session")
def tiny_model_dir():
    return build_default_model()
