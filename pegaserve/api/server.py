"""`python -m pegaserve.api.server`: the colocated server on uvicorn, without Ray."""

from __future__ import annotations

import argparse

import uvicorn

from pegaserve.api.app import build_app
from pegaserve.api.local import build_local_server
from pegaserve.default_model import DEFAULT_MODEL_NAME


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=DEFAULT_MODEL_NAME, help="qwen3-tiny or a local HF model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "sdpa", "triton"])
    args = parser.parse_args()
    app = build_app(build_local_server(args.model, attention_backend=args.attention_backend))
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
