"""ASGI guards in front of the app: API keys, the Host allowlist, JSON-only bodies, the body size
limit, and admission control.

Every check reads the route's path, the request's path less the app's `root_path` (where it is
mounted: a Serve `route_prefix`, a reverse proxy's prefix), as the router does; so what is guarded
does not depend on where the app is mounted. With keys, every route but /health needs one (the
OpenAPI schema and docs included; with admin keys, /admin takes only those). Without keys, only requests whose Host names this machine's
loopback (or an allowed host) are served: a web page a local browser opens cannot reach the server
through a DNS name rebound to 127.0.0.1. A POST body must be JSON (`content-type:
application/json`): a page cannot send one cross-origin without the browser asking first (a form's
or `text/plain`'s body would be sent at once).

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client disconnects pass
through untouched. Keys are compared in constant time and never logged. A request's key names the
owner of what it stores (`owner_of`, in `request.state.owner`): stored chat completions and
responses are seen only by requests with the same key.
"""

from __future__ import annotations

import hashlib
import hmac
import json

from pegaserve.api.errors import ApiError
from pegaserve.config import Limits

PUBLIC_PATHS = ("/health",)
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")


class Guards:
    def __init__(self, app, api_keys: tuple[str, ...] = (), max_body_bytes: int = Limits.max_body_bytes,
                 max_inflight: int | None = None, retry_after_s: int = 1,
                 allowed_hosts: tuple[str, ...] = LOOPBACK_HOSTS, admin_api_keys: tuple[str, ...] = ()) -> None:
        self.app = app
        self.api_keys = tuple(k.encode() for k in api_keys if k)  # an empty key would admit an empty token
        self.admin_api_keys = tuple(k.encode() for k in admin_api_keys if k)
        self.allowed_hosts = None if "*" in allowed_hosts else frozenset(h.lower() for h in allowed_hosts)
        self.max_body_bytes = max_body_bytes
        self.max_inflight = max_inflight
        self.retry_after_s = retry_after_s
        self.inflight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        headers = dict(scope.get("headers") or [])
        admin = self.admin_api_keys and (path == "/admin" or path.startswith("/admin/"))
        keys = self.admin_api_keys if admin else self.api_keys
        if keys:
            key = self._key(headers, keys)
            if key is not None:
                scope.setdefault("state", {})["owner"] = owner_of(key)
            elif path not in PUBLIC_PATHS:
                error = ApiError("invalid or missing API key: send Authorization: Bearer <key>", status=401)
                await _reply(send, error, {"www-authenticate": "Bearer"})
                return
        elif self.allowed_hosts is not None and not _exempt(path) and _host(headers) not in self.allowed_hosts:
            error = ApiError("this Host is not served: set api_keys, or name it in allowed_hosts", param="host")
            await _reply(send, error)
            return
        if scope.get("method") == "POST":
            body = await _read_body(receive, self.max_body_bytes)
            if body is None:
                await _reply(send, ApiError(f"request body exceeds {self.max_body_bytes} bytes", status=413))
                return
            content_type = headers.get(b"content-type")
            if (body or content_type is not None) and not _is_json(content_type):
                error = ApiError("the request body must be JSON, sent as content-type: application/json",
                                 status=415, param="content-type")
                await _reply(send, error)
                return
            receive = _replay(body, receive)
        if self.max_inflight is not None and path.startswith("/v1/") and scope.get("method") == "POST":
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

    @staticmethod
    def _key(headers: dict[bytes, bytes], keys: tuple[bytes, ...]) -> bytes | None:
        """The one of `keys` the request's bearer token is, if it is one."""
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return None
        return next((key for key in keys if hmac.compare_digest(token, key)), None)


def owner_of(key: bytes) -> str:
    """Who stored objects belong to: a hash of the API key (the key itself is never kept)."""
    return hashlib.sha256(b"pegaserve-owner\0" + key).hexdigest()[:32]


def route_path(scope) -> str:
    """The path the app's router sees: the request's, less the prefix the app is mounted under."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] or "/" if root and path.startswith(root) else path


def _exempt(path: str) -> bool:
    """Probes that need no Host: /health, and Serve's own (`/-/...`)."""
    return path in PUBLIC_PATHS or path.startswith("/-/")


def _host(headers: dict[bytes, bytes]) -> str:
    """The Host header's name, without its port (an IPv6 literal without its brackets)."""
    host = headers.get(b"host", b"").decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return False
    media = content_type.split(b";")[0].strip().lower()
    return media == b"application/json" or (media.startswith(b"application/") and media.endswith(b"+json"))


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
