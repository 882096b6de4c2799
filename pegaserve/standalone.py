"""pegaserve in one process, without Ray: one engine does prefill and decode on a thread of this
process, behind the same OpenAI app the Ray ingress serves. `python -m pegaserve` runs it."""

from __future__ import annotations

import argparse
from dataclasses import replace

from pegaserve.api.app import build_app
from pegaserve.api.frontend import Frontend
from pegaserve.api.guards import LOOPBACK_HOSTS
from pegaserve.api.model_info import model_info, served_name
from pegaserve.api.services import LocalEngineClient, LocalLedgerClient
from pegaserve.attention.registry import AUTO, backend_names
from pegaserve.config import EngineConfig, Limits
from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.engine.build import load_engine
from pegaserve.engine.core import EngineCore
from pegaserve.heap import freeze_startup_heap
from pegaserve.models.config import ModelConfig, ModelLoadError
from pegaserve.models.tiny import DEFAULT_MODEL_NAME, ensure_model_dir
from pegaserve.tokenizer import Tokenizer


def build_local_frontend(
    model: str = DEFAULT_MODEL_NAME,
    engine_config: EngineConfig = EngineConfig(),
    engine: EngineCore | None = None,
    attention_backend: str = "auto",
    limits: Limits = Limits(),
) -> Frontend:
    """`engine=None` loads the model's weights; tests pass their own (e.g.
    `pegaserve.testing.scripted.scripted_engine`), built with the same `engine_config`."""
    model_dir = ensure_model_dir(model)
    if engine is None:
        engine = load_engine(model_dir, engine_config, attention_backend)
    info = model_info(served_name(model), ModelConfig.from_dir(model_dir), engine_config.max_model_len)
    limits = replace(limits, scheduling_policy=engine_config.scheduling_policy)
    return Frontend(LocalEngineClient(AsyncEngine.in_thread(engine)), Tokenizer(model_dir), info,
                    LocalLedgerClient(), limits)


def main(argv: list[str] | None = None) -> None:
    import uvicorn  # noqa: PLC0415 - only the command line needs a server

    parser = argparse.ArgumentParser(prog="python -m pegaserve", description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="qwen3-tiny or a local HF model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--api-key", action="append", default=[], help="needed as `Authorization: Bearer` (repeatable)")
    parser.add_argument("--allowed-hosts", default=",".join(LOOPBACK_HOSTS),
                        help="without a key, the Host names served, comma-separated ('*': any)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--attention-backend", default=AUTO, choices=backend_names())
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's own context")
    args = parser.parse_args(argv)
    try:
        frontend = build_local_frontend(args.model, EngineConfig(max_model_len=args.max_model_len),
                                        attention_backend=args.attention_backend)
    except ModelLoadError as exc:  # e.g. an architecture no family is registered for: one line, no traceback
        parser.exit(2, f"{parser.prog}: {exc}\n")
    app = build_app(frontend, tuple(args.api_key), allowed_hosts=tuple(h for h in args.allowed_hosts.split(",") if h))
    freeze_startup_heap()
    uvicorn.run(app, host=args.host, port=args.port)
