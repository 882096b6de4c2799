"""The waiting queue of the priority scheduling policy (`EngineConfig.scheduling_policy`): requests
in rank order, priority then arrival (`EngineRequest.rank`)."""

from __future__ import annotations

from bisect import bisect_left, insort

from pegaserve.request import RequestState


def rank(request: RequestState) -> tuple[int, float]:
    return request.engine_request.rank


class RankedQueue:
    """The waiting queue under the priority policy, in rank order (`EngineRequest.rank`), with the
    deque's methods the scheduler uses: a preempted request (`appendleft`) goes before the others of
    its rank, a new one after them."""

    def __init__(self) -> None:
        self._items: list[RequestState] = []

    def append(self, request: RequestState) -> None:
        insort(self._items, request, key=rank)

    def appendleft(self, request: RequestState) -> None:
        self._items.insert(bisect_left(self._items, request.engine_request.rank, key=rank), request)

    def extend(self, requests) -> None:
        for request in requests:
            self.append(request)

    def popleft(self) -> RequestState:
        return self._items.pop(0)

    def remove(self, request: RequestState) -> None:
        self._items.remove(request)

    def __getitem__(self, index: int) -> RequestState:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    def __contains__(self, request) -> bool:
        return request in self._items
