"""Prefill role: the leases on parked requests' blocks. A choice whose first token is out is parked
with its blocks held for export until decode has copied them or its lease runs out."""

from __future__ import annotations

import time
from collections.abc import Iterable

from pegaserve.messages import ParkedKv
from pegaserve.request import RequestState, Status


class Leases:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.parked: dict[str, RequestState] = {}  # choice id -> the parked choice
        self.deadlines: dict[str, float] = {}  # choice id -> when its blocks are freed

    def park(self, request: RequestState, block_ids: list[int], generations: Iterable[int]) -> ParkedKv:
        request.set_status(Status.PARKED)
        self.parked[request.request_id] = request
        held_until = self.deadlines[request.request_id] = time.monotonic() + self.timeout_s
        return ParkedKv(block_ids, tuple(generations), held_until)

    def drop(self, choice_id: str) -> None:
        self.parked.pop(choice_id, None)
        self.deadlines.pop(choice_id, None)

    def of(self, choice_ids: Iterable[str]) -> list[RequestState]:
        return [self.parked[c] for c in choice_ids if c in self.parked]

    def expired(self, now: float) -> list[RequestState]:
        return [self.parked[c] for c, deadline in self.deadlines.items() if deadline <= now]
