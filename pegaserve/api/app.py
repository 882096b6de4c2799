"""The OpenAI-compatible FastAPI app. The same app runs in process (colocated) and inside the Ray
Serve ingress (P/D): only the engine and ledger clients differ."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pegaserve.api import validation as v
from pegaserve.api.errors import ApiError
from pegaserve.api.guards import Guards
from pegaserve.api.protocol import ChatCompletionRequest, CompletionRequest
from pegaserve.api.serving import Job, Server, new_request_id, now_s
from pegaserve.api.wire import Wire

log = logging.getLogger(__name__)


def build_app(server: Server, api_keys: tuple[str, ...] = (), max_inflight: int | None = None) -> FastAPI:
    """The OpenAI app. With `api_keys`, every /v1 and /admin route needs `Authorization: Bearer`;
    past `max_inflight` concurrent generations the API answers 429 with Retry-After."""
    app = FastAPI(title="pegaserve", version="0.1.0")
    app.state.server = server
    _install_error_handlers(app)
    app.add_middleware(Guards, api_keys=tuple(api_keys), max_body_bytes=server.limits.max_body_bytes,
                       max_inflight=max_inflight)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        m = server.model
        return {"object": "list", "data": [{"id": m.name, "object": "model", "created": 0, "owned_by": "pegaserve",
                                            "root": m.root, "max_model_len": m.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await _respond(server, _completion_job(server, body, request))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await _respond(server, _chat_job(server, body, request))

    @app.get("/admin/ledger")
    async def ledger_summary() -> dict:
        return await server.ledger.summary()

    @app.get("/admin/ledger/{request_id}")
    async def ledger_record(request_id: str) -> dict:
        record = await server.ledger.get(request_id)
        if record is None:
            raise ApiError(f"no ledger record for request {request_id!r}", param="request_id", status=404)
        return record

    @app.get("/admin/stats")
    async def stats() -> dict:
        return await server.engine.stats()

    return app


def _completion_job(server: Server, body: CompletionRequest, request: Request) -> Job:
    v.check_model(body, server.model)
    v.check_unsupported(body)
    v.check_completion_only(body)
    num_top = v.completion_logprobs(body, server.limits)
    prompts = [_completion_prompt_ids(server, p) for p in _split_prompts(body.prompt)]
    plans = [v.plan_choice(body, ids, server.model, server.limits, body.max_tokens, num_top) for ids in prompts]
    request_id = new_request_id("cmpl", request.headers.get("x-request-id"))
    wire = Wire(False, request_id, server.model.name, now_s(), _token_text(server), num_top,
                logprobs=body.logprobs is not None, return_token_ids=body.return_token_ids)
    return Job(request_id, plans, wire, body.stream, _include_usage(body))


def _chat_job(server: Server, body: ChatCompletionRequest, request: Request) -> Job:
    v.check_model(body, server.model)
    v.check_unsupported(body)
    num_top = v.chat_logprobs(body, server.limits)
    if not body.messages:
        raise v.invalid("messages", "at least one message is required")
    messages = [{"role": m.role, "content": _message_text(m.content)} for m in body.messages]
    try:
        text = server.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
    except Exception as exc:  # a template that rejects the conversation is the client's problem
        raise v.invalid("messages", f"the chat template rejected the messages: {exc}") from exc
    ids = v.check_prompt_ids(server.tokenizer.encode(text), server.model, "messages", server.limits)
    max_tokens, param = body.max_completion_tokens, "max_completion_tokens"
    if max_tokens is None:
        max_tokens, param = body.max_tokens, "max_tokens"
    plan = v.plan_choice(body, ids, server.model, server.limits, max_tokens, num_top, param)
    request_id = new_request_id("chatcmpl", request.headers.get("x-request-id"))
    wire = Wire(True, request_id, server.model.name, now_s(), _token_text(server), num_top,
                logprobs=body.logprobs, return_token_ids=body.return_token_ids)
    return Job(request_id, [plan], wire, body.stream, _include_usage(body))


def _split_prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise v.invalid("prompt", "the prompt is empty")
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def _completion_prompt_ids(server: Server, prompt: str | list[int]) -> tuple[int, ...]:
    ids = server.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    return v.check_prompt_ids(ids, server.model, "prompt", server.limits)


def _message_text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise v.invalid("messages", "only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def _include_usage(body) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _token_text(server: Server):
    return lambda token_id: server.tokenizer.decode([token_id], skip_special_tokens=False)


async def _respond(server: Server, job: Job):
    headers = {"X-Request-Id": job.request_id}
    if not job.stream:
        return JSONResponse(await server.complete(job), headers=headers)
    chunks = server.stream(job)
    first = await anext(chunks, None)  # admission errors (400, 429) still get their HTTP status
    return StreamingResponse(_sse(first, chunks), media_type="text/event-stream", headers=headers)


async def _sse(first: dict | None, chunks: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        if first is not None:
            yield f"data: {json.dumps(first)}\n\n"
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
    except ApiError as exc:
        yield f"data: {json.dumps(exc.body())}\n\n"
    except Exception as exc:  # headers are gone: report in-band, never a torn stream
        log.exception("stream failed")
        yield f"data: {json.dumps(ApiError(f'internal error: {exc}', status=500).body())}\n\n"
    yield "data: [DONE]\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response({"retry-after": "1"} if exc.status in (429, 503) else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        param = "body" if exc.status_code == 400 else None  # FastAPI's only 400: an unparsable body
        return ApiError(str(exc.detail), param=param, status=exc.status_code).response(exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return ApiError(f"internal error: {type(exc).__name__}", status=500).response()


def _validation_error(exc: RequestValidationError) -> ApiError:
    """pydantic's first complaint, as a 400 naming the parameter (never a 422)."""
    errors = exc.errors()
    if not errors:
        return ApiError("invalid request", param=None)
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(f"malformed JSON: {first.get('msg')}", param=None)
    param = loc[0] if loc else None
    where = ".".join(loc) or "body"
    return ApiError(f"{where}: {first.get('msg')}", param=param)
