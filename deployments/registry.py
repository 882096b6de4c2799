"""Two named actors every replica of the cluster can find: the board where engine replicas post their
stats (so /admin/stats sees them all), and the directory of prefill replicas' KV servers (so an
ingress can tell every live one to free a lease it will not use). One owner each."""

from __future__ import annotations

import time

import ray

from pegaserve.deployments.ledger import NAMESPACE
from pegaserve.net.channel import Address

STATS_BOARD_NAME = "pegaserve-stats"
KV_SERVERS_NAME = "pegaserve-kv-servers"
LIVE_S = 30.0  # a replica silent this long is gone


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class StatsBoard:
    """The latest engine stats of every replica, so /admin/stats sees them all (a Serve call would
    reach one replica chosen at random)."""

    def __init__(self) -> None:
        self.stats: dict[str, tuple[float, dict]] = {}

    def post(self, replica: str, stats: dict) -> None:
        self.stats[replica] = (time.time(), stats)

    def read(self, prefix: str = "", max_age_s: float = LIVE_S) -> dict:
        now = time.time()
        return {name: s for name, (t, s) in self.stats.items() if name.startswith(prefix) and now - t <= max_age_s}


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class KvServerDirectory:
    """Where each live prefill replica's KV server listens (with its token). A replica announces
    itself every second or so; one silent for `LIVE_S` is left out."""

    def __init__(self) -> None:
        self.servers: dict[str, tuple[float, Address]] = {}  # prefill replica -> (last heard, address)

    def announce(self, replica: str, address: Address) -> None:
        self.servers[replica] = (time.time(), address)

    def addresses(self, prefix: str = "") -> list[Address]:
        """The KV servers of the live prefill replicas whose names start with `prefix` (an app's)."""
        now = time.time()
        return [a for name, (t, a) in self.servers.items() if name.startswith(prefix) and now - t <= LIVE_S]


def stats_board():
    return StatsBoard.options(name=STATS_BOARD_NAME, namespace=NAMESPACE, get_if_exists=True,
                              lifetime="detached").remote()


def kv_servers():
    return KvServerDirectory.options(name=KV_SERVERS_NAME, namespace=NAMESPACE, get_if_exists=True,
                                     lifetime="detached").remote()
