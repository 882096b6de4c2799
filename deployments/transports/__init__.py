"""The KV transports that need Ray, registered with pegaserve's transport registry
(pegaserve/pd/transports/registry.py) when this package is imported — deployments/config.py
imports it before it checks a config's `transport` — beside the CPU ones built in there:

- `nccl`: pair channels of `ray.util.collective` (cupy's NCCL) between GPU replicas.
- `object_store`: the packed prompt through Ray's object store (`ray.put` / `ray.get`).
"""

from __future__ import annotations

from pegaserve.deployments.transports.nccl import NcclTransport
from pegaserve.deployments.transports.object_store import ObjectStoreTransport
from pegaserve.pd.transports.registry import register_transport

register_transport(NcclTransport)
register_transport(ObjectStoreTransport)
