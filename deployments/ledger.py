"""The lifecycle ledger as a named Ray actor hosting a `pegaserve.ledger.Ledger`, the buffer each
replica records through, and the board where replicas post their engine stats (one owner each:
the ledger keeps request records, the board keeps replica stats).
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray

from pegaserve.ledger import Ledger, LedgerEvent

log = logging.getLogger("ray.serve")
LEDGER_NAME = "pegaserve-ledger"
STATS_BOARD_NAME = "pegaserve-stats"
NAMESPACE = "pegaserve"
LEDGER_NAMESPACE = NAMESPACE
FLUSH_PERIOD_S = 0.01
ORPHAN_TIMEOUT_S = 30.0  # an ingress silent this long has died: its requests' records end as errors


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class LedgerActor:
    """Restarted by Ray when it dies; calls made meanwhile are retried, and finished records come
    back from the journal."""

    def __init__(self, max_records: int = 10_000, journal: str | None = None) -> None:
        self.ledger = Ledger(max_records, journal)
        self.heard_from: dict[str, float] = {}  # component -> when it last recorded or pinged

    def record(self, batches: list[tuple[str, list[LedgerEvent]]]) -> None:
        now = time.time()
        for component, events in batches:
            self.heard_from[component] = now
            self.ledger.record(events, component, now)
        self._end_orphans(now)

    def heartbeat(self, component: str) -> None:
        self.heard_from[component] = time.time()
        self._end_orphans(time.time())

    def _end_orphans(self, now: float) -> None:
        silent = {c for c, t in self.heard_from.items() if now - t > ORPHAN_TIMEOUT_S}
        if silent:
            self.ledger.end_orphans(silent, f"its ingress ({', '.join(sorted(silent))}) stopped answering")
            for component in silent:
                del self.heard_from[component]

    def get(self, request_id: str) -> dict | None:
        return self.ledger.get(request_id)

    def summary(self) -> dict:
        self._end_orphans(time.time())
        return self.ledger.summary()


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class StatsBoard:
    """The latest engine stats of every replica, so /admin/stats sees them all (a Serve call would
    reach one replica chosen at random)."""

    def __init__(self) -> None:
        self.stats: dict[str, tuple[float, dict]] = {}

    def post(self, replica: str, stats: dict) -> None:
        self.stats[replica] = (time.time(), stats)

    def read(self, prefix: str = "", max_age_s: float = 30.0) -> dict:
        now = time.time()
        return {name: s for name, (t, s) in self.stats.items() if name.startswith(prefix) and now - t <= max_age_s}


def ledger_actor(max_records: int, journal: str | None):
    """The one ledger of this Ray cluster; detached so it outlives the app that made it."""
    return LedgerActor.options(name=LEDGER_NAME, namespace=NAMESPACE, get_if_exists=True,
                               lifetime="detached").remote(max_records, journal)


def stats_board():
    return StatsBoard.options(name=STATS_BOARD_NAME, namespace=NAMESPACE, get_if_exists=True,
                              lifetime="detached").remote()


class LedgerBuffer:
    """Ledger events from one replica, sent in batches (a Ray call per 10 ms at most, not one per
    event). `record` queues; `await record_now(...)` sends everything queued and waits for it (the
    ingress does, at a request's finish, so the ledger agrees with the answer before it ends)."""

    def __init__(self, actor, component: str) -> None:
        self.actor = actor
        self.component = component
        self._queued: list[LedgerEvent] = []
        self._flush: asyncio.Task | None = None

    def record(self, events: list[LedgerEvent]) -> None:
        self._queued += events
        if self._flush is None:
            self._flush = asyncio.ensure_future(self._flush_soon())

    async def record_now(self, events: list[LedgerEvent]) -> None:
        self._queued += events
        await self._send()

    async def _flush_soon(self) -> None:
        await asyncio.sleep(FLUSH_PERIOD_S)
        self._flush = None
        await self._send()

    async def _send(self) -> None:
        events, self._queued = self._queued, []
        if not events:
            return
        try:
            await self.actor.record.remote([(self.component, events)])
        except Exception:  # the ledger restarts on its own; losing a batch must not fail requests
            log.exception("recording %d ledger events failed", len(events))

    async def heartbeat_forever(self, period_s: float = 5.0) -> None:
        while True:
            try:
                await self.actor.heartbeat.remote(self.component)
            except Exception:
                log.warning("ledger heartbeat failed", exc_info=True)
            await asyncio.sleep(period_s)
