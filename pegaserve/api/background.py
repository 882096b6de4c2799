"""Background responses (`background: true`, with `store`): the POST is answered at once with the
response `queued`; the generation runs on in this frontend, its stored response going
`in_progress`, then to its end (`completed`, `incomplete` or `failed`), which `GET
/v1/responses/{id}` reads. `POST /v1/responses/{id}/cancel` stops it (`cancelled`).

Every change of status is a compare-and-set on the store (`ResponseStore.replace`): a cancel and an
end never overwrite each other, whichever ingress replica each came through. A cancel that came
through this frontend stops the generation at once; one through another replica (behind Ray, the
store is shared), at the generation's next look at the store, every `poll_s`. A generation lives
in the frontend that started it; each look renews its response's `alive_until`, and a response
read after that (that process died) is `failed`, not left `in_progress` for good. A generation
whose response left the store (deleted, or the store restarted empty) stops at its next look.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time

from pegaserve.api.errors import ApiError, invalid
from pegaserve.api.response_store import ACTIVE, ResponseStore

log = logging.getLogger(__name__)

POLL_S = 0.5
LOST_AFTER_POLLS = 10  # a response whose generation has not looked for this many polls is lost


class BackgroundResponses:
    """The background responses a frontend runs, over the store that holds their state."""

    def __init__(self, store: ResponseStore, poll_s: float = POLL_S) -> None:
        self.store = store
        self.poll_s = poll_s
        self._running: dict[str, asyncio.Task] = {}

    async def get(self, response_id: str) -> dict | None:
        """The stored response, as readers see it: one whose generation stopped looking is `failed`."""
        stored = await self.store.get(response_id)
        if stored is None or stored["response"]["status"] not in ACTIVE or stored["alive_until"] >= time.time():
            return stored
        return await self._ended(response_id, stored, status="failed", error={
            "code": "server_error", "message": "the server that was generating it stopped"})

    async def start(self, frontend, job, view) -> dict:
        """Store the response `queued`, start generating it (`frontend.complete(job)`), and return it.
        The generation runs in a context of its own: not a child of the request that started it,
        so nothing that request's end cancels."""
        queued = view.with_status("queued")
        await self.store.put(view.id, self._alive(view, queued))
        task = asyncio.get_running_loop().create_task(self._run(frontend, job, view), context=contextvars.Context())
        self._running[view.id] = task
        task.add_done_callback(lambda _: self._running.pop(view.id, None))
        return queued

    async def cancel(self, response_id: str, stored: dict) -> dict:
        """The response (`stored`, as the store held it), cancelled if it was queued or in progress;
        as it is if it had ended."""
        response = stored["response"]
        if not response.get("background"):
            raise invalid("response_id", "only a background response can be cancelled")
        if response["status"] in ACTIVE:
            stored = await self._ended(response_id, stored, status="cancelled")
            task = self._running.get(response_id)
            if task is not None and stored["response"]["status"] == "cancelled":
                task.cancel()
        return stored["response"]

    async def _ended(self, response_id: str, stored: dict, **changes) -> dict:
        """`stored` with its response ended by `changes`, if it was still queued or in progress (a
        compare-and-set); else what the store holds now (it ended meanwhile)."""
        ended = {**stored, "response": {**stored["response"], **changes}}
        if await self.store.replace(response_id, ended, ACTIVE):
            return ended
        return await self.store.get(response_id) or stored

    def _alive(self, view, response: dict) -> dict:
        """What the store keeps of a queued or running response: alive for `LOST_AFTER_POLLS` looks."""
        return {**view.stored(response), "alive_until": self._alive_until()}

    def _alive_until(self) -> float:
        return time.time() + LOST_AFTER_POLLS * self.poll_s

    async def _run(self, frontend, job, view) -> None:
        if not await self.store.replace(view.id, self._alive(view, view.with_status("in_progress")), ("queued",)):
            return  # cancelled, deleted or dropped before it started
        generation = asyncio.ensure_future(frontend.complete(job))
        try:
            while not (await asyncio.wait({generation}, timeout=self.poll_s))[0]:
                if not await self.store.keep_alive(view.id, self._alive_until()):
                    return  # cancelled through another replica, or deleted
            final = view.finished(generation.result())
        except ApiError as exc:
            final = view.failed([], exc.message)
        except Exception:
            log.exception("background response %s failed", view.id)
            final = view.failed([], "the response could not be generated")
        finally:
            if not generation.done():
                generation.cancel()  # its engine requests are aborted as it closes
                await asyncio.wait({generation})
        await self.store.replace(view.id, view.stored(final), ACTIVE)
