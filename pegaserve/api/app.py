"""The OpenAI-compatible FastAPI app. The same app runs in process (standalone) and inside the Ray
Serve ingress (P/D): only the engine and ledger clients differ."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Literal, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pegaserve.api import tokenize
from pegaserve.api.body import parse_body
from pegaserve.api.errors import ApiError, invalid
from pegaserve.api.frontend import FAILED, Frontend, Job
from pegaserve.api.guards import LOOPBACK_HOSTS, Guards
from pegaserve.api.jobs import chat_job, completion_job
from pegaserve.api.protocol import (
    ChatCompletionRequest,
    ChatUpdate,
    CompletionRequest,
    DetokenizeRequest,
    ResponsesRequest,
    SamplingKnobs,
    TokenizeRequest,
)
from pegaserve.api.responses.endpoint import continued, responses_job
from pegaserve.api.responses.view import ResponseView
from pegaserve.api.stored_chats import page
from pegaserve.api.validation import check_model

log = logging.getLogger(__name__)
REQUEST_ID_HEADER = "x-request-id"
LARGE_BODY_BYTES = 32 << 10  # parsed and tokenized off the event loop (`off_the_loop_if_large`)
T = TypeVar("T")


def build_app(frontend: Frontend, api_keys: tuple[str, ...] = (), max_inflight: int | None = None,
              echo_request_id: bool = True, allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS,
              admin_api_keys: tuple[str, ...] = ()) -> FastAPI:
    """The OpenAI app. With `api_keys`, every route but /health needs `Authorization: Bearer`;
    with `admin_api_keys`, /admin needs one of those instead; without keys, only `allowed_hosts`
    are served (api/guards.py says why); past `max_inflight`
    concurrent generations the API answers 429 with Retry-After. A response carries the client's X-Request-Id (or its own id) unless
    `echo_request_id` is off: behind Ray Serve, which sets that header itself, it would be there twice."""
    app = FastAPI(title="pegaserve", version="0.1.0")
    app.state.frontend = frontend
    _install_error_handlers(app)
    app.add_middleware(Guards, api_keys=tuple(api_keys), max_body_bytes=frontend.limits.max_body_bytes,
                       max_inflight=max_inflight, allowed_hosts=tuple(allowed_hosts),
                       admin_api_keys=tuple(admin_api_keys))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    def model_card() -> dict:
        m = frontend.model
        return {"id": m.name, "object": "model", "created": 0, "owned_by": "pegaserve", "root": m.root,
                "max_model_len": m.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve (`client.models.retrieve`); a local path holds '/'
    async def model(model: str) -> dict:
        check_model(model, frontend.model)
        return model_card()

    async def generate(request: Request, fields: type, make_job: Callable[..., Job]):
        def build() -> Job:
            body = parse_body(raw, fields, frontend.limits.refuse_unknown_fields)
            return replace(make_job(frontend, body, _client_id(request, body, echo_request_id)), owner=_owner(request))

        raw = await request.body()
        return await _respond(frontend, await off_the_loop_if_large(raw, build), echo_request_id=echo_request_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionRequest, completion_job)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatCompletionRequest, chat_job)

    @app.get("/v1/chat/completions")
    async def stored_chats(request: Request, model: str | None = None, after: str | None = None, limit: int = 20,
                           order: Literal["asc", "desc"] = "asc") -> dict:
        metadata = {key[len("metadata["):-1]: value for key, value in request.query_params.items()
                    if key.startswith("metadata[") and key.endswith("]")}
        return await frontend.chats.list(model, metadata, after, limit, order, _owner(request))

    @app.get("/v1/chat/completions/{completion_id}")
    async def stored_chat(completion_id: str, request: Request) -> dict:
        return (await frontend.chats.get(completion_id, _owner(request)))["completion"]

    @app.post("/v1/chat/completions/{completion_id}")
    async def update_stored_chat(completion_id: str, request: Request) -> dict:
        update = parse_body(await request.body(), ChatUpdate)
        return await frontend.chats.update(completion_id, update.metadata, _owner(request))

    @app.delete("/v1/chat/completions/{completion_id}")
    async def delete_stored_chat(completion_id: str, request: Request) -> dict:
        return await frontend.chats.delete(completion_id, _owner(request))

    @app.get("/v1/chat/completions/{completion_id}/messages")
    async def stored_chat_messages(completion_id: str, request: Request, after: str | None = None, limit: int = 20,
                                   order: Literal["asc", "desc"] = "asc") -> dict:
        return await frontend.chats.messages(completion_id, after, limit, order, _owner(request))

    @app.post("/v1/responses")
    async def responses(request: Request):
        raw = await request.body()
        body = await off_the_loop_if_large(raw, lambda: parse_body(raw, ResponsesRequest, frontend.limits.refuse_unknown_fields))
        previous = await continued(frontend.background, body, _owner(request))

        def build() -> tuple[Job, ResponseView]:
            job, view = responses_job(frontend, body, _client_id(request, body, echo_request_id), previous,
                                      _owner(request))
            return replace(job, owner=_owner(request)), view

        job, view = await off_the_loop_if_large(raw, build)
        if body.background:
            queued = await frontend.background.start(frontend, job, view)
            if body.stream:
                return await _named_events(frontend.background.follow(view.id), _echoed(job, echo_request_id))
            return JSONResponse(queued, headers=_echoed(job, echo_request_id))
        return await _respond(frontend, job, view, echo_request_id=echo_request_id)

    def not_stored(response_id: str) -> ApiError:
        return ApiError(f"no stored response {response_id[:80]!r}", param="response_id", status=404)

    async def stored(response_id: str, request: Request) -> dict:
        found = await frontend.background.get(response_id, _owner(request))
        if found is None:
            raise not_stored(response_id)
        return found

    @app.get("/v1/responses/{response_id}")
    async def stored_response(response_id: str, request: Request, stream: bool = False,
                              starting_after: int | None = None, include_obfuscation: bool = False):
        found = await stored(response_id, request)
        if include_obfuscation:
            raise invalid("include_obfuscation", "is not supported (only false)")
        if starting_after is not None and (not stream or starting_after < 0):
            raise invalid("starting_after", "needs stream=true, and is a sequence number (at least 0)")
        if not stream:
            return found["response"]
        if "events" not in found:
            raise invalid("stream", "only a response created with background and stream can be streamed")
        return await _named_events(frontend.background.follow(response_id, -1 if starting_after is None
                                                              else starting_after), {})

    @app.get("/v1/responses/{response_id}/input_items")
    async def stored_input_items(response_id: str, request: Request, order: Literal["asc", "desc"] = "desc",
                                 limit: int = 20, after: str | None = None) -> dict:
        return page((await stored(response_id, request))["input"], after, limit, order, key=lambda item: item["id"])

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> dict:
        return await frontend.background.cancel(response_id, await stored(response_id, request))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict:
        await stored(response_id, request)
        if not await frontend.responses.delete(response_id):
            raise not_stored(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict:
        raw = await request.body()
        return await off_the_loop_if_large(raw, lambda: tokenize.tokenize(frontend, parse_body(raw, TokenizeRequest, frontend.limits.refuse_unknown_fields)))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict:
        return tokenize.detokenize(frontend, parse_body(await request.body(), DetokenizeRequest, frontend.limits.refuse_unknown_fields))

    @app.get("/admin/ledger")
    async def ledger_summary() -> dict:
        return await frontend.ledger.summary()

    @app.get("/admin/ledger/{key}")
    async def ledger_record(key: str) -> dict:
        record = await frontend.ledger_record(key)
        if record is None:
            raise ApiError(f"no ledger record for request {key!r}", param="request_id", status=404)
        return record

    @app.get("/admin/stats")
    async def stats() -> dict:
        return await frontend.engine.stats()

    return app


async def off_the_loop_if_large(raw: bytes, build: Callable[[], T]) -> T:
    """`build()` — parsing, validating and tokenizing the body `raw` — in a worker thread when the
    body is large, so that tokenizing it (`jobs.encode`) stalls no other stream of this app."""
    if len(raw) < LARGE_BODY_BYTES:
        return build()
    return await asyncio.to_thread(build)


def _owner(request: Request) -> str | None:
    """Whose key the request came with (api/guards.py sets it); None on a server without keys."""
    return getattr(request.state, "owner", None)


def _client_id(request: Request, body: SamplingKnobs, header_is_clients: bool) -> str | None:
    """The X-Request-Id header. Behind Serve (`echo_request_id` off) the header is there even when
    the client sent none, Serve having made one up, so the body's `request_id` comes first."""
    if not header_is_clients and body.request_id is not None:
        return None
    return request.headers.get(REQUEST_ID_HEADER)


async def _respond(frontend: Frontend, job: Job, view: ResponseView | None = None, *, echo_request_id: bool):
    """The job's body, or its stream: chat and completion chunks, or (with `view`, the Responses
    API's) the response's typed events (`_named_events`)."""
    log.info("request %s: client id %r, %d prompt(s), n=%d", job.response_id, job.client_request_id,
             len(job.prompts), job.n)
    headers = _echoed(job, echo_request_id)
    if not job.stream:
        body = await frontend.complete(job)
        return JSONResponse(body if view is None else await view.response(body), headers=headers)
    if view is not None:
        return await _named_events(view.events(frontend.stream(job)), headers)
    chunks = frontend.stream(job)
    first = await anext(chunks, None)  # admission errors (400, 429) still get their HTTP status
    return StreamingResponse(_sse(first, chunks), media_type="text/event-stream", headers=headers)


async def _named_events(events: AsyncIterator[dict], headers: dict[str, str]) -> StreamingResponse:
    """The Responses API's typed events, each named in its SSE `event:` line, with no `[DONE]`."""
    first = await anext(events, None)  # admission errors (400, 429) still get their HTTP status
    return StreamingResponse(_sse(first, events, named=True), media_type="text/event-stream", headers=headers)


def _echoed(job: Job, echo_request_id: bool) -> dict[str, str]:
    return {"X-Request-Id": job.client_request_id or job.response_id} if echo_request_id else {}


async def _sse(first: dict | None, chunks: AsyncIterator[dict], named: bool = False) -> AsyncIterator[bytes]:
    try:
        if first is not None:
            yield _event(first, named)
        async for chunk in chunks:
            yield _event(chunk, named)
    except ApiError as exc:
        yield _event(exc.body())
    except Exception:  # headers are gone: report in-band, never a torn stream
        log.exception("stream failed")
        yield _event(ApiError(FAILED, status=500).body())
    finally:
        await chunks.aclose()
    if not named:
        yield b"data: [DONE]\n\n"


def _event(body: dict, named: bool = False) -> bytes:
    """One SSE event, once per token of every stream: orjson (~4 us less than the standard encoder
    per chunk here), compact UTF-8 as the JSON responses are. What it refuses (a lone surrogate a
    client sent, an int past 64 bits) the standard encoder writes, escaped. `named`: the event's
    `type` in an `event:` line too (the Responses API's)."""
    try:
        data = orjson.dumps(body)
    except orjson.JSONEncodeError:
        data = json.dumps(body, separators=(",", ":")).encode()
    name = f"event: {body['type']}\n".encode() if named and "type" in body else b""
    return name + b"data: " + data + b"\n\n"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        return exc.response({"retry-after": "1"} if exc.status in (429, 503) else None)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(str(exc.detail), param=None, status=exc.status_code).response(exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # bodies are parsed by `parse_body`: this is a query parameter (GET /v1/responses/{id}...)
        error = (exc.errors() or [{}])[0]
        name = str(error.get("loc", ("", None))[-1]) if error.get("loc") else None
        return ApiError(f"{name}: {error.get('msg', 'invalid')}" if name else "invalid request", param=name).response()

    @app.exception_handler(Exception)
    async def internal_error(_: Request, exc: Exception) -> JSONResponse:
        log.exception("request failed")
        return ApiError(FAILED, status=500).response()
