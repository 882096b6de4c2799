"""The lifecycle ledger as a named Ray actor: it hosts a `pegaserve.ledger.Ledger`, and the latest
engine stats each replica reports (so /admin/stats sees every replica, not one routed at random)."""

from __future__ import annotations

import time

import ray

from pegaserve.ledger import Ledger, LedgerEvent

LEDGER_NAME = "pegaserve-ledger"
LEDGER_NAMESPACE = "pegaserve"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class LedgerActor:
    """Restarted by Ray when it dies; calls made meanwhile are retried, and finished records come
    back from the journal."""

    def __init__(self, max_records: int = 10_000, journal: str | None = None) -> None:
        self.ledger = Ledger(max_records, journal)
        self.replica_stats: dict[str, tuple[float, dict]] = {}

    def record(self, events: list[LedgerEvent], component: str) -> None:
        self.ledger.record(events, component)

    def get(self, request_id: str) -> dict | None:
        return self.ledger.get(request_id)

    def summary(self) -> dict:
        return self.ledger.summary()

    def report_stats(self, replica: str, stats: dict) -> None:
        self.replica_stats[replica] = (time.time(), stats)

    def stats(self, max_age_s: float = 30.0) -> dict:
        now = time.time()
        return {name: s for name, (t, s) in self.replica_stats.items() if now - t <= max_age_s}


def get_or_create_ledger(max_records: int, journal: str | None):
    """The one ledger of this Ray cluster; detached so it outlives the app that made it."""
    return LedgerActor.options(
        name=LEDGER_NAME, namespace=LEDGER_NAMESPACE, get_if_exists=True, lifetime="detached"
    ).remote(max_records, journal)
