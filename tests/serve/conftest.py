"""The Serve tests run Serve as `make serve` does: throughput-optimized, HAProxy in front
(set before anything imports Ray Serve, which reads them once)."""

import os

from pegaserve.deployments.env import SERVE_ENV

os.environ.update({k: v for k, v in SERVE_ENV.items() if k not in os.environ})
# a deleted test app's ingress need not wait the 30 s a load balancer may take to deregister it
os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")
# HAProxy's metrics and stats ports are per machine: keep off a `make serve`'s (9101, 8404), as the
# tests' HTTP port keeps off its 8000
os.environ.setdefault("RAY_SERVE_HAPROXY_METRICS_PORT", "8125")
os.environ.setdefault("RAY_SERVE_HAPROXY_STATS_PORT", "8126")
