"""ASGI guards in front of the app: API keys, the body size limit, and admission control.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client disconnects pass
through untouched. Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
import json

from pegaserve.api.errors import ApiError
from pegaserve.config import Limits

PROTECTED_PREFIXES = ("/v1", "/admin", "/tokenize", "/detokenize")


class Guards:
    def __init__(self, app, api_keys: tuple[str, ...] = (), max_body_bytes: int = Limits.max_body_bytes,
                 max_inflight: int | None = None, retry_after_s: int = 1) -> None:
        self.app = app
        self.api_keys = tuple(k.encode() for k in api_keys)
        self.max_body_bytes = max_body_bytes
        self.max_inflight = max_inflight
        self.retry_after_s = retry_after_s
        self.inflight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if self.api_keys and path.startswith(PROTECTED_PREFIXES) and not self._authorized(scope):
            error = ApiError("invalid or missing API key: send Authorization: Bearer <key>", status=401)
            await _reply(send, error, {"www-authenticate": "Bearer"})
            return
        if scope.get("method") == "POST":
            body = await _read_body(receive, self.max_body_bytes)
            if body is None:
                await _reply(send, ApiError(f"request body exceeds {self.max_body_bytes} bytes", status=413))
                return
            receive = _replay(body, receive)
        if self.max_inflight is not None and path.startswith("/v1") and scope.get("method") == "POST":
            if self.inflight >= self.max_inflight:
                error = ApiError("the server is at capacity; retry later", status=429)
                await _reply(send, error, {"retry-after": str(self.retry_after_s)})
                return
            self.inflight += 1
            try:
                await self.app(scope, receive, send)
            finally:
                self.inflight -= 1
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or []).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return any(hmac.compare_digest(token.strip(), key) for key in self.api_keys)


async def _read_body(receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect, as a live socket would

    return replay


async def _reply(send, error: ApiError, headers: dict[str, str] | None = None) -> None:
    payload = json.dumps(error.body()).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})
