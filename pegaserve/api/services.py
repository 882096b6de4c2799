"""What the frontend talks to: an engine client and a ledger client, in process or across Ray.

The P/D deployments implement the same two interfaces, so the HTTP app is one and the same.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from pegaserve.engine.async_engine import AsyncEngine
from pegaserve.ledger import Ledger, LedgerEvent
from pegaserve.messages import EngineRequest, StepOutput


class EngineClient(ABC):
    @abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        """The outputs of every choice of `request` (ids `request.choice_id(i)`), interleaved, until
        all have finished; each choice's first output carries the prompt logprobs if asked for.
        Closing the iterator early aborts whatever still runs, on whichever replica holds it."""

    @abstractmethod
    def abort(self, choice_id: str) -> None:
        """Stop one choice now (a stop string fired in it); the others go on."""

    async def stats(self) -> dict:
        return {}


class LedgerClient(ABC):
    @abstractmethod
    async def record(self, events: list[LedgerEvent], component: str) -> None: ...

    @abstractmethod
    async def get(self, request_id: str) -> dict | None: ...

    @abstractmethod
    async def summary(self) -> dict: ...


class LocalEngineClient(EngineClient):
    """Colocated: one engine, prefill and decode, in this process."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def generate(self, request: EngineRequest) -> AsyncIterator[StepOutput]:
        return self.engine.generate(request)

    def abort(self, choice_id: str) -> None:
        self.engine.abort(choice_id)

    async def stats(self) -> dict:
        stats = await self.engine.stats()
        return {"colocated": [stats.__dict__]}


class LocalLedgerClient(LedgerClient):
    def __init__(self, ledger: Ledger | None = None) -> None:
        self.ledger = ledger or Ledger()

    async def record(self, events: list[LedgerEvent], component: str) -> None:
        self.ledger.record(events, component)

    async def get(self, request_id: str) -> dict | None:
        return self.ledger.get(request_id)

    async def summary(self) -> dict:
        return self.ledger.summary()
