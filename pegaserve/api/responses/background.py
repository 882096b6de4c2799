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

Streamed (`background` and `stream`): the response's events are kept with it (its `events`, whose
index is their `sequence_number`): `follow` gives them from any point, then each as it comes, to
the POST that started it and to `GET /v1/responses/{id}?stream=true&starting_after=N` (a client
that lost its stream picks it up where it left off). Through this frontend each event comes the
moment it is made; through another replica, from the store, to which the generation adds them
every `flush_s` (each such look renewing it as above). A client that leaves stops nothing; a
cancel ends the stream after the events made until then (GET then reads `cancelled`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pegaserve.api.errors import ApiError, invalid
from pegaserve.api.responses.store import ACTIVE, ResponseStore

log = logging.getLogger(__name__)

PREFIX = "resp_"  # a response's id; the store's other keys are stored chats' (`chatcmpl-`), never read here
POLL_S = 0.5
FLUSH_S = 0.05  # a streamed response's new events reach the store (and readers through other replicas) this often
LOST_AFTER_POLLS = 10  # a response whose generation has not looked for this many polls is lost


@dataclass
class _Events:
    """A streamed background response's events as this frontend makes them."""

    events: list[dict]
    stored: int  # how many of them the store has
    ended: bool = False
    changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def add(self, *events: dict, ended: bool = False) -> None:
        async with self.changed:
            self.events.extend(events)
            self.ended = self.ended or ended
            self.changed.notify_all()

    async def after(self, index: int) -> tuple[list[dict], bool]:
        """The events after the `index`th, once there is one (or none, at the end); whether it ended."""
        async with self.changed:
            await self.changed.wait_for(lambda: len(self.events) > index + 1 or self.ended)
            return self.events[index + 1:], self.ended

    def unstored(self) -> list[dict]:
        new, self.stored = self.events[self.stored:], len(self.events)
        return new


class BackgroundResponses:
    """The background responses a frontend runs, over the store that holds their state."""

    def __init__(self, store: ResponseStore, poll_s: float = POLL_S, flush_s: float = FLUSH_S) -> None:
        self.store = store
        self.poll_s = poll_s
        self.flush_s = flush_s
        self._running: dict[str, asyncio.Task] = {}
        self._streams: dict[str, _Events] = {}  # the streamed responses generated here

    async def get(self, response_id: str, owner: str | None) -> dict | None:
        """The stored response, if it is `owner`'s (api/guards.py `owner_of`; None: no keys)."""
        stored = await self._read(response_id)
        return stored if stored is not None and stored.get("owner") == owner else None

    async def _read(self, response_id: str) -> dict | None:
        """The stored response, as readers see it: one whose generation stopped looking is `failed`.
        None for an id that is not a response's."""
        stored = await self.store.get(response_id) if response_id.startswith(PREFIX) else None
        if stored is None or stored["response"]["status"] not in ACTIVE or stored["alive_until"] >= time.time():
            return stored
        return await self._ended(response_id, stored, status="failed", error={
            "code": "server_error", "message": "the server that was generating it stopped"})

    async def start(self, frontend, job, view) -> dict:
        """Store the response `queued`, start generating it (`frontend.complete(job)`, or its
        `stream` for a streamed response, whose events `follow` reads), and return it. The
        generation runs in a context of its own: not a child of the request that started it, so
        nothing that request's end cancels."""
        queued = view.with_status("queued")
        stored = self._alive(view, queued)
        if view.body.stream:
            events = view.queued_events()
            self._streams[view.id] = _Events(events, len(events))
            stored["events"] = list(events)
        await self.store.put(view.id, stored)
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

    async def follow(self, response_id: str, after: int = -1) -> AsyncIterator[dict]:
        """A streamed response's events after the `after`th, then each as it comes, to its end."""
        events = self._streams.get(response_id)
        if events is not None:  # generated here: every event the moment it is made
            while True:
                new, ended = await events.after(after)
                for event in new:
                    yield event
                after += len(new)
                if ended:
                    return
        while (stored := await self._read(response_id)) is not None:  # generated elsewhere, or over
            for event in stored.get("events", ())[after + 1:]:
                yield event
                after += 1
            if stored["response"]["status"] not in ACTIVE:
                return
            await asyncio.sleep(self.flush_s)

    async def _run(self, frontend, job, view) -> None:
        events = self._streams.get(view.id)
        try:
            in_progress = self._alive(view, view.with_status("in_progress"))
            if events is not None:
                in_progress["events"] = events.events[: events.stored]
            if not await self.store.replace(view.id, in_progress, ("queued",)):
                return  # cancelled, deleted or dropped before it started
            await self._generate(frontend, job, view, events)
        finally:
            if events is not None:
                await events.add(ended=True)
                self._streams.pop(view.id, None)

    async def _generate(self, frontend, job, view, events: _Events | None) -> None:
        if events is None:
            generation = asyncio.ensure_future(frontend.complete(job))
        else:
            generation = asyncio.ensure_future(self._stream(frontend, job, view, events))
        try:
            while not (await asyncio.wait({generation}, timeout=self.poll_s if events is None else self.flush_s))[0]:
                if not await self.store.keep_alive(view.id, self._alive_until(), events.unstored() if events else ()):
                    return  # cancelled through another replica, or deleted
            final = view.finished(generation.result()) if events is None else generation.result()
        except ApiError as exc:
            final = view.failed([], exc.message)
        except Exception:
            log.exception("background response %s failed", view.id)
            final = view.failed([], "the response could not be generated")
        finally:
            if not generation.done():
                generation.cancel()  # its engine requests are aborted as it closes
                await asyncio.wait({generation})
        stored = view.stored(final)
        if events is not None:
            if final["status"] == "failed" and events.events[-1]["type"] != "response.failed":
                await events.add(*view.failure_events(final["output"], final["error"]))
            stored["events"] = events.events
        await self.store.replace(view.id, stored, ACTIVE)

    @staticmethod
    async def _stream(frontend, job, view, events: _Events) -> dict:
        """The response's events into `events`, as they are made; the response they end with."""
        async for event in view.events(frontend.stream(job), background=True):
            await events.add(event)
        return events.events[-1]["response"]
