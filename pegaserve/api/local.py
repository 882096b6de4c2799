"""A colocated server in this process: one engine does prefill and decode (no Ray)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from pegaserve.api.clients import LocalEngineClient, LocalLedgerClient
from pegaserve.api.serving import Server
from pegaserve.api.validation import Limits, ModelInfo
from pegaserve.default_model import DEFAULT_MODEL_NAME, ensure_model_dir
from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.engine.build import load_engine, scripted_engine
from pegaserve.engine.engine import EngineConfig
from pegaserve.engine.model_config import ModelConfig
from pegaserve.tokenizer import Tokenizer


def model_info(name: str, config: ModelConfig, max_model_len: int | None, tokenizer: Tokenizer) -> ModelInfo:
    """What the API validates against; `max_model_len=None` means the model's own context."""
    eos = set(config.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return ModelInfo(
        name=name,
        root=str(config.model_dir),
        max_model_len=min(max_model_len or config.max_position_embeddings, config.max_position_embeddings),
        vocab_size=config.vocab_size,
        eos_token_ids=frozenset(eos),
    )


def served_name(model: str) -> str:
    return DEFAULT_MODEL_NAME if model == DEFAULT_MODEL_NAME else Path(model).name


def build_local_server(
    model: str = DEFAULT_MODEL_NAME,
    engine_config: EngineConfig = EngineConfig(),
    script: Mapping[Sequence[int], Sequence[int]] | None = None,
    attention_backend: str = "auto",
    limits: Limits = Limits(),
) -> Server:
    """`script` swaps the weights for a `ScriptedModel` (tests); the tokenizer stays the model's."""
    model_dir = ensure_model_dir(model)
    if script is None:
        engine = load_engine(model_dir, engine_config, attention_backend)
    else:
        engine = scripted_engine(model_dir, script, engine_config)
    tokenizer = Tokenizer(model_dir)
    info = model_info(served_name(model), ModelConfig.from_dir(model_dir), engine_config.max_model_len, tokenizer)
    return Server(LocalEngineClient(AsyncEngine(engine)), tokenizer, info, LocalLedgerClient(), limits)
