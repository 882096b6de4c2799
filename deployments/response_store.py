"""The Responses API's stored responses (`pegaserve.api.responses.store`) as one named Ray actor,
shared by every ingress replica: a response stored through one is continued through another."""

from __future__ import annotations

import ray

from pegaserve.api.responses.store import MemoryResponseStore, ResponseStore
from pegaserve.deployments.ledger import NAMESPACE, DetachedCalls

RESPONSE_STORE_NAME = "pegaserve-responses"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class ResponseStoreActor:
    """Memory only: restarted by Ray when it dies, it has lost what it held (a continuation of a
    lost response is a 400 naming `previous_response_id`)."""

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.store = MemoryResponseStore(max_responses, max_bytes)

    async def put(self, response_id: str, stored: dict) -> None:
        await self.store.put(response_id, stored)

    async def get(self, response_id: str) -> dict | None:
        return await self.store.get(response_id)

    async def delete(self, response_id: str) -> bool:
        return await self.store.delete(response_id)

    async def select(self, prefix: str) -> list[dict]:
        return await self.store.select(prefix)

    async def replace(self, response_id: str, stored: dict, statuses: tuple[str, ...] | None) -> bool:
        return await self.store.replace(response_id, stored, statuses)

    async def keep_alive(self, response_id: str, until: float, events: list[dict] = ()) -> bool:
        return await self.store.keep_alive(response_id, until, events)


class ActorResponseStore(ResponseStore):
    """The store actor, called off the request (`DetachedCalls`: a cancelled client leaves no gap)."""

    def __init__(self, max_responses: int, max_bytes: int, detached: DetachedCalls) -> None:
        self.actor = ResponseStoreActor.options(name=RESPONSE_STORE_NAME, namespace=NAMESPACE, get_if_exists=True,
                                                lifetime="detached").remote(max_responses, max_bytes)
        self.detached = detached

    async def put(self, response_id: str, stored: dict) -> None:
        await self.detached.call(lambda: self.actor.put.remote(response_id, stored))

    async def get(self, response_id: str) -> dict | None:
        return await self.detached.call(lambda: self.actor.get.remote(response_id))

    async def delete(self, response_id: str) -> bool:
        return await self.detached.call(lambda: self.actor.delete.remote(response_id))

    async def select(self, prefix: str) -> list[dict]:
        return await self.detached.call(lambda: self.actor.select.remote(prefix))

    async def replace(self, response_id: str, stored: dict, statuses: tuple[str, ...] | None) -> bool:
        return await self.detached.call(lambda: self.actor.replace.remote(response_id, stored, statuses))

    async def keep_alive(self, response_id: str, until: float, events: list[dict] = ()) -> bool:
        return await self.detached.call(lambda: self.actor.keep_alive.remote(response_id, until, list(events)))
