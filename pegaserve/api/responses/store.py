"""Stored responses, the Responses API's `store` (on by default, as OpenAI's): what
`previous_response_id` continues, and what `GET` and `DELETE /v1/responses/{id}` (and its
`/input_items`) read.

A stored response is `{"response": <the response object>, "input": <its input items>, "items":
<the conversation it continues, then its input and output items>}` — JSON, so that it crosses
Ray as it is. Instructions are not part of the conversation: a response continued from another
does not inherit them (OpenAI's rule). The store keeps the most recent `max_responses`, at most
`max_bytes` of them (their JSON), in memory, never dropping a background response still queued or
in progress;
behind Ray one store actor serves every ingress replica (deployments/response_store.py).
A background response's status moves by `replace`, a compare-and-set, and it carries `alive_until`,
which its generation renews (`keep_alive`; pegaserve/api/responses/background.py); a streamed one, its
`events` too, which `keep_alive` adds to. Stored chat completions (`store` on chat) share the store,
under their `chatcmpl-` ids (pegaserve/api/stored_chats.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

import orjson

MAX_RESPONSES = 1000
MAX_BYTES = 256 << 20
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
    """The most recent `max_responses` within `max_bytes`, the oldest dropped first (reading one keeps
    it), an active background response never."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._stored: OrderedDict[str, dict] = OrderedDict()
        self._sizes: dict[str, int] = {}

    async def put(self, response_id: str, stored: dict) -> None:
        self._stored[response_id] = stored
        self._stored.move_to_end(response_id)
        self._resize(response_id, len(orjson.dumps(stored)))
        self._evict()

    def _resize(self, response_id: str, size: int) -> None:
        self.num_bytes += size - self._sizes.get(response_id, 0)
        self._sizes[response_id] = size

    def _evict(self) -> None:
        for key in list(self._stored):
            if len(self._stored) <= self.max_responses and self.num_bytes <= self.max_bytes:
                return
            if not _active(self._stored[key]):
                self._drop(key)

    def _drop(self, response_id: str) -> dict | None:
        self.num_bytes -= self._sizes.pop(response_id, 0)
        return self._stored.pop(response_id, None)

    async def get(self, response_id: str) -> dict | None:
        stored = self._stored.get(response_id)
        if stored is not None:
            self._stored.move_to_end(response_id)
        return stored

    async def delete(self, response_id: str) -> bool:
        return self._drop(response_id) is not None

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
            self._resize(response_id, self._sizes.get(response_id, 0) + len(orjson.dumps(list(events))))
        return True


def _active(stored: dict) -> bool:
    """A background response still queued or in progress (its generation will store its end)."""
    response = stored.get("response")
    return isinstance(response, dict) and response.get("status") in ACTIVE
