"""Where this process runs, as the cluster names it. The Ray edge (`pegaserve.deployments.node`)
asks Ray once and passes it in; nothing under pegaserve/ looks it up."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NodeInfo:
    node_id: str  # two processes with the same id share a machine (and its shared memory)
    ip: str  # the address peers on other nodes reach this one at (listeners, rendezvous)
