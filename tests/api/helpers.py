"""Builders shared by the API tests: a standalone frontend on the scripted double or the real
weights, and an in-process HTTP client for its app."""

from __future__ import annotations

import json

import httpx
import torch

from pegaserve.api.frontend import Frontend
from pegaserve.config import EngineConfig, Limits
from pegaserve.standalone import build_local_frontend
from pegaserve.testing.scripted import scripted_engine

PROMPT = [151644, 40000, 198]


def scripted_frontend(model_dir, script: dict, engine_config: EngineConfig = EngineConfig(),
                      limits: Limits = Limits()) -> Frontend:
    return build_local_frontend(engine_config=engine_config, engine=scripted_engine(model_dir, script, engine_config),
                                limits=limits)


def real_frontend(engine_config: EngineConfig = EngineConfig(num_blocks=512)) -> Frontend:
    """qwen3-tiny's real (random) weights, fp32 on the CPU."""
    return build_local_frontend(engine_config=engine_config, attention_backend="sdpa")


def client_for(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=120)


def raw_json(body) -> bytes:
    """JSON as a client may send it: ASCII escapes, so lone surrogates (`\\ud800`) survive."""
    return json.dumps(body).encode()


def sse_chunks(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def reference_beams(hf, prompt, width: int, max_tokens: int) -> list[tuple[tuple[int, ...], list[float]]]:
    """Beam search over transformers' logits (no EOS): each beam's tokens and their logprobs, best
    first. Asserts no two candidates at the cut are closer than fp32 noise."""
    live = [((), [])]
    for _ in range(max_tokens):
        candidates = []
        for tokens, logprobs in live:
            with torch.inference_mode():
                row = hf(input_ids=torch.tensor([list(prompt) + list(tokens)])).logits[0, -1].double()
            top = torch.log_softmax(row, -1).topk(2 * width)
            candidates += [(tokens + (t,), logprobs + [v]) for v, t in zip(top.values.tolist(), top.indices.tolist())]
        candidates.sort(key=lambda c: -sum(c[1]))
        assert sum(candidates[width - 1][1]) - sum(candidates[width][1]) > 1e-3, "pick a prompt without a near tie"
        live = candidates[:width]
    return live
