"""A recording reverse proxy between the harness and pegaserve.

Every request is forwarded unchanged to the upstream server and appended, with its answer, to a
JSON-lines file: {"method", "path", "status", "request", "response"} (`status` null and `error`
set when the upstream could not be reached). The checker reads it to see exactly what the
harness sent and got, retries included, which lm_eval's logged samples do not show.
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from aiohttp import ClientSession, ClientTimeout, web


class Recorder:
    """Serves on 127.0.0.1 (a free port) in a thread of its own until `stop`."""

    def __init__(self, upstream_url: str, traffic_path: Path, timeout_s: float = 300.0) -> None:
        self.upstream_url = upstream_url.rstrip("/")
        self.traffic_path = traffic_path
        self.timeout_s = timeout_s
        self.url: str | None = None  # set by start
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="eval-recorder", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: ClientSession | None = None
        self._file = None

    def start(self) -> str:
        self._file = self.traffic_path.open("w")
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._serve(), self._loop).result(timeout=30)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._file.close()

    async def _serve(self) -> int:
        self._session = ClientSession(timeout=ClientTimeout(total=self.timeout_s))
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        return self._runner.addresses[0][1]

    async def _close(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    async def _forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        record = {"method": request.method, "path": request.path_qs, "request": _json_or_text(body)}
        headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
        try:
            async with self._session.request(request.method, self.upstream_url + request.path_qs,
                                             data=body or None, headers=headers) as upstream:
                payload = await upstream.read()
                status, content_type = upstream.status, upstream.headers.get("Content-Type")
        except Exception as e:  # noqa: BLE001 - any failure to reach upstream is recorded and answered 502
            self._write({**record, "status": None, "error": repr(e), "response": None})
            return web.json_response({"error": {"message": f"recorder: upstream failed: {e!r}"}}, status=502)
        self._write({**record, "status": status, "response": _json_or_text(payload)})
        return web.Response(body=payload, status=status, headers={"Content-Type": content_type or "text/plain"})

    def _write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()


def _json_or_text(raw: bytes) -> object:
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")
