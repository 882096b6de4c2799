"""Stored responses, the Responses API's `store` (on by default, as OpenAI's): what
`previous_response_id` continues, and what `GET` and `DELETE /v1/responses/{id}` (and its
`/input_items`) read.

A stored response is `{"response": <the response object>, "input": <its input items>, "items":
<the conversation it continues, then its input and output items>}` — JSON, so that it crosses
Ray as it is. Instructions are not part of the conversation: a response continued from another
does not inherit them (OpenAI's rule). The store keeps the most recent `max_responses` in memory;
behind Ray one store actor serves every ingress replica (deployments/response_store.py).
A background response's status moves by `replace`, a compare-and-set, and it carries `alive_until`,
which its generation renews (`keep_alive`; pegaserve/api/responses/background.py); a streamed one, its
`events` too, which `keep_alive` adds to. Stored chat completions (`store` on chat) share the store,
under their `chatcmpl-` ids (pegaserve/api/stored_chats.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

MAX_RESPONSES = 1000
ACTIVE = ("queued", "in_progress")  # a background response's statuses before its end


class ResponseStore(ABC):
    @abstractmethod
    async def put(self, response_id: str, stored: dict) -> None: ...

    @abstractmethod
    async def get(self, response_id: str) -> dict | None: ...

    @abstractmethod
    async def delete(self, response_id: str) -> bool:
        """Whether it was there."""

    @abstractmethod
    async def select(self, prefix: str) -> list[dict]:
        """Everything stored under an id that starts with `prefix`."""

    @abstractmethod
    async def replace(self, response_id: str, stored: dict, statuses: tuple[str, ...] | None) -> bool:
        """Store `stored` in place of what is there, if something is and (unless `statuses` is None)
        its response's status is one of `statuses` (at once: nothing comes between the look and the
        write); whether it did."""

    @abstractmethod
    async def keep_alive(self, response_id: str, until: float) -> bool:
        """A background response's generation is alive `until` (seconds, wall clock): whether its
        response is still queued or in progress (else nothing changes)."""


class MemoryResponseStore(ResponseStore):
    """The most recent `max_responses`, the oldest dropped first (reading one keeps it)."""

    def __init__(self, max_responses: int = MAX_RESPONSES) -> None:
        self.max_responses = max_responses
        self._stored: OrderedDict[str, dict] = OrderedDict()

    async def put(self, response_id: str, stored: dict) -> None:
        self._stored[response_id] = stored
        self._stored.move_to_end(response_id)
        while len(self._stored) > self.max_responses:
            self._stored.popitem(last=False)

    async def get(self, response_id: str) -> dict | None:
        stored = self._stored.get(response_id)
        if stored is not None:
            self._stored.move_to_end(response_id)
        return stored

    async def delete(self, response_id: str) -> bool:
        return self._stored.pop(response_id, None) is not None

    async def select(self, prefix: str) -> list[dict]:
        return [stored for key, stored in self._stored.items() if key.startswith(prefix)]

    async def replace(self, response_id: str, stored: dict, statuses: tuple[str, ...] | None) -> bool:
        present = self._stored.get(response_id)
        if present is None or (statuses is not None and present["response"]["status"] not in statuses):
            return False
        await self.put(response_id, stored)  # never suspends: the look and the write are one step
        return True

    async def keep_alive(self, response_id: str, until: float, events: list[dict] = ()) -> bool:
        present = self._stored.get(response_id)
        if present is None or present["response"]["status"] not in ACTIVE:
            return False
        present["alive_until"] = until
        if events:
            present.setdefault("events", []).extend(events)
        return True
