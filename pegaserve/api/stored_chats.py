"""OpenAI's stored chat completions (`store: true` on chat): the whole completion, streamed or not,
is kept with its `metadata` and its request's messages before the client has its last byte, in the
store the Responses API keeps its responses in (pegaserve/api/responses/store.py: the most recent
`max_stored_responses` of both, in memory; behind Ray one actor every ingress replica shares).
`GET /v1/chat/completions` lists them (`model`, `metadata[key]=value`, `after`, `limit`, `order`),
`GET`/`POST`/`DELETE /v1/chat/completions/{id}` read one, replace its metadata, drop it, and
`GET .../{id}/messages` lists its request's messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pegaserve.api.errors import ApiError, invalid
from pegaserve.api.responses.store import ResponseStore

PREFIX = "chatcmpl-"  # a chat completion's id; the store's other keys are responses' (`resp_...`)
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512  # OpenAI's limits


def check_metadata(metadata: Mapping[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_KEYS:
        raise invalid("metadata", f"holds at most {MAX_METADATA_KEYS} pairs, got {len(metadata)}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise invalid("metadata", f"keys are at most {MAX_METADATA_KEY} characters and values at most "
                                      f"{MAX_METADATA_VALUE} ({key[:80]!r})")


def page(items: list[dict], after: str | None, limit: int, order: str, key: Callable[[dict], str]) -> dict:
    """OpenAI's list object: `items` (in ascending order) from after the one whose id is `after`,
    at most `limit` of them, in `order`."""
    if not 1 <= limit <= 100:
        raise invalid("limit", f"must be in [1, 100], got {limit}")
    items = items[:: 1 if order == "asc" else -1]
    if after is not None:
        ids = [key(item) for item in items]
        if after not in ids:
            raise invalid("after", f"no item {after[:80]!r} in this list")
        items = items[ids.index(after) + 1:]
    data = items[:limit]
    return {"object": "list", "data": data, "first_id": key(data[0]) if data else None,
            "last_id": key(data[-1]) if data else None, "has_more": len(items) > limit}


@dataclass(frozen=True)
class StoredChat:
    """What a stored completion keeps beside itself: its request's messages and its metadata."""

    messages: list[dict]
    metadata: Mapping[str, str] | None


class StoredChats:
    def __init__(self, store: ResponseStore) -> None:
        self.store = store

    async def keep(self, completion: dict, chat: StoredChat, owner: str | None) -> None:
        """Keep `completion` for `owner` (api/guards.py `owner_of` of its key; None: no keys)."""
        given = [{"id": f"{completion['id']}-{i}", **message} for i, message in enumerate(chat.messages)]
        await self.store.put(completion["id"], {"completion": {**completion, "metadata": dict(chat.metadata or {})},
                                                "messages": given, "stored_at": time.time(), "owner": owner})

    async def get(self, completion_id: str, owner: str | None) -> dict:
        """The stored completion, if it is `owner`'s (another's is as unknown as a missing one)."""
        stored = await self.store.get(completion_id) if completion_id.startswith(PREFIX) else None
        if stored is None or stored.get("owner") != owner:
            raise _not_stored(completion_id)
        return stored

    async def update(self, completion_id: str, metadata: Mapping[str, str] | None, owner: str | None) -> dict:
        check_metadata(metadata)
        stored = await self.get(completion_id, owner)
        stored = {**stored, "completion": {**stored["completion"], "metadata": dict(metadata or {})}}
        if not await self.store.replace(completion_id, stored, None):  # deleted meanwhile: not brought back
            raise _not_stored(completion_id)
        return stored["completion"]

    async def delete(self, completion_id: str, owner: str | None) -> dict:
        await self.get(completion_id, owner)
        if not await self.store.delete(completion_id):
            raise _not_stored(completion_id)
        return {"object": "chat.completion.deleted", "id": completion_id, "deleted": True}

    async def list(self, model: str | None, metadata: Mapping[str, str], after: str | None, limit: int,
                   order: str, owner: str | None) -> dict:
        stored = sorted(await self.store.select(PREFIX), key=lambda s: s["stored_at"])
        found = [s["completion"] for s in stored
                 if s.get("owner") == owner and (model is None or s["completion"]["model"] == model)
                 and all(s["completion"]["metadata"].get(k) == v for k, v in metadata.items())]
        return page(found, after, limit, order, key=lambda c: c["id"])

    async def messages(self, completion_id: str, after: str | None, limit: int, order: str,
                       owner: str | None) -> dict:
        return page((await self.get(completion_id, owner))["messages"], after, limit, order, key=lambda m: m["id"])


def _not_stored(completion_id: str) -> ApiError:
    return ApiError(f"no stored chat completion {completion_id[:80]!r}", param="completion_id", status=404)
