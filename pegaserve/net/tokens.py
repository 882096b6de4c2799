"""Tokens from engine replicas to ingress replicas in per-step batches.

An engine replica (Decode, Colocated) sends every engine step's outputs as ONE frame per ingress
replica that waits for some of them — not one Serve streaming item per request per step. The
ingress replica's `TokenInbox` listens for those frames and hands each output to the stream of
its choice; the same connection carries the ingress's per-choice aborts back (a stop string fired
in one choice of several).

The Serve call that started a request stays open until the request is done, so Serve's routing,
queue limits and autoscaling still see every request in flight, and a replica that dies fails
the calls it held. Each call has a tag that its outputs carry: after a request moved to another
replica, anything still arriving from the old one is dropped.

No Ray here: the inbox listens on the address it is given (the Ray edge, the ingress,
gives it the node's).
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from dataclasses import dataclass

from pegaserve.messages import StepOutput
from pegaserve.net.channel import Address, Connection, Listener, connect

log = logging.getLogger("ray.serve")


@dataclass(frozen=True)
class AbortChoice:
    choice_id: str


class TokenInbox:
    """The ingress side: one listener per ingress replica (on `host`, its node's address); outputs
    go to per-request queues."""

    def __init__(self, host: str) -> None:
        self._listener = Listener(self._serve, host)
        self._queues: dict[str, tuple[int, asyncio.Queue]] = {}  # choice id -> (the call's tag, its queue)
        self._senders: dict[str, Connection] = {}  # choice id -> the connection its tokens come on
        self._aborted: set[str] = set()  # choices to stop as soon as their replica is known

    async def start(self) -> Address:
        return await self._listener.start()

    @property
    def address(self) -> Address:
        assert self._listener.address is not None, "start() first"
        return self._listener.address

    @property
    def serving(self) -> bool:
        return self._listener.serving

    def open(self, choice_ids: list[str], outputs: asyncio.Queue, tag: int) -> None:
        """Deliver these choices' outputs that carry `tag` to `outputs` (a later open re-tags)."""
        for choice_id in choice_ids:
            self._queues[choice_id] = (tag, outputs)
            self._senders.pop(choice_id, None)

    def close(self, choice_ids: list[str]) -> None:
        for choice_id in choice_ids:
            self._queues.pop(choice_id, None)
            self._senders.pop(choice_id, None)
            self._aborted.discard(choice_id)

    def abort(self, choice_id: str) -> None:
        """Ask the replica producing `choice_id` to stop it: now, or as soon as it first speaks."""
        self._queues.pop(choice_id, None)
        connection = self._senders.get(choice_id)
        if connection is not None and not connection.closed:
            connection.send(AbortChoice(choice_id))
        else:
            self._aborted.add(choice_id)

    async def _serve(self, connection: Connection) -> None:
        while (outputs := await connection.recv()) is not None:
            for tag, output in outputs:
                target = self._queues.get(output.request_id)
                if output.request_id in self._aborted and output.finish is None:
                    self._aborted.discard(output.request_id)
                    connection.send(AbortChoice(output.request_id))
                if target is None or target[0] != tag:
                    continue  # the request is gone, or moved on: the replica learns by its abort
                self._senders[output.request_id] = connection
                target[1].put_nowait(output)

    def sender_of(self, choice_id: str) -> str | None:
        """The replica that last sent this choice's tokens."""
        connection = self._senders.get(choice_id)
        return None if connection is None else connection.peer


class TokenRouter:
    """The engine replica side: it gets each step's outputs (from `AsyncEngine.on_step`) and sends
    them, one frame per destination ingress."""

    def __init__(self, name: str, on_abort) -> None:
        self.name = name
        self.on_abort = on_abort  # called with a choice id the ingress asked to stop
        self._routes: dict[str, tuple[Address, asyncio.Future, int]] = {}  # choice id -> (its ingress, done, tag)
        self._pending: dict[asyncio.Future, set[str]] = {}  # a request's done -> its unfinished choices
        self._connections: dict[Address, Connection] = {}
        self._connecting: dict[Address, asyncio.Task] = {}
        self._backlog: dict[Address, list[tuple[int, StepOutput]]] = defaultdict(list)

    def route(self, choice_ids: list[str], destination: Address, tag: int) -> asyncio.Future:
        """Send these choices' outputs to `destination`; the future is done when all have finished."""
        done = asyncio.get_running_loop().create_future()
        for choice_id in choice_ids:
            self._routes[choice_id] = (destination, done, tag)
        self._pending[done] = set(choice_ids)
        return done

    def unroute(self, choice_ids: list[str]) -> None:
        for choice_id in choice_ids:
            self._drop(choice_id)

    def _drop(self, choice_id: str) -> None:
        """The choice needs no more routing (finished, or aborted); a request whose every choice
        is dropped is done."""
        route = self._routes.pop(choice_id, None)
        if route is None:
            return
        done = route[1]
        unfinished = self._pending.get(done)
        if unfinished is not None:
            unfinished.discard(choice_id)
            if not unfinished:
                del self._pending[done]
                if not done.done():
                    done.set_result(None)

    def on_step(self, outputs: list[StepOutput]) -> None:
        batches: dict[Address, list[tuple[int, StepOutput]]] = defaultdict(list)
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue
            batches[route[0]].append((route[2], output))
            if output.finish is not None:
                self._drop(output.request_id)
        for destination, batch in batches.items():
            self._send(destination, batch)

    def fail(self, error: BaseException) -> None:
        """The engine is gone: every request waiting here fails."""
        for done in list(self._pending):
            if not done.done():
                done.set_exception(error)
        self._pending.clear()
        self._routes.clear()

    def _send(self, destination: Address, batch: list[tuple[int, StepOutput]]) -> None:
        connection = self._connections.get(destination)
        if connection is not None and not connection.closed:
            connection.send(batch)
            return
        self._backlog[destination] += batch
        if destination not in self._connecting:
            self._connecting[destination] = asyncio.ensure_future(self._connect(destination))

    async def _connect(self, destination: Address) -> None:
        try:
            connection = await connect(destination, self.name)
        except (OSError, asyncio.TimeoutError) as exc:
            log.warning("cannot reach ingress %s:%s (%s); its requests are aborted", destination.host,
                        destination.port, exc)
            self._abandon(destination)
            return
        finally:
            self._connecting.pop(destination, None)
        self._connections[destination] = connection
        backlog = self._backlog.pop(destination, [])
        if backlog:
            connection.send(backlog)
        asyncio.ensure_future(self._listen(destination, connection))

    async def _listen(self, destination: Address, connection: Connection) -> None:
        """Aborts from the ingress; the connection's end means the ingress is gone."""
        while (message := await connection.recv()) is not None:
            if isinstance(message, AbortChoice) and message.choice_id in self._routes:
                self._drop(message.choice_id)
                self.on_abort(message.choice_id)
        if self._connections.get(destination) is connection:
            del self._connections[destination]
        self._abandon(destination)

    def _abandon(self, destination: Address) -> None:
        self._backlog.pop(destination, None)
        for choice_id, (address, _, _) in list(self._routes.items()):
            if address == destination:
                self._drop(choice_id)
                self.on_abort(choice_id)
