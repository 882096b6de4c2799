"""pegaserve's Ray metrics (`pegaserve_*`), exported on each Ray node's Prometheus endpoint and
shown by the Ray dashboard / Grafana (configs/grafana-pegaserve.json).

Every metric is tagged with the model and the deployment it was measured in."""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from pegaserve.api.observer import RequestObserver
from pegaserve.engine.engine import EngineStats
from pegaserve.stop import StopCause, cause_kind, finish_reason

LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60]
TAGS = ("model", "deployment")


class IngressMetrics(RequestObserver):
    """Latency and token counts as the client saw them."""

    def __init__(self, model: str, deployment: str = "Ingress") -> None:
        self.tags = {"model": model, "deployment": deployment}
        self.ttft = Histogram("pegaserve_ttft_seconds", "time to first token", LATENCY_BUCKETS_S, TAGS)
        self.itl = Histogram("pegaserve_inter_token_latency_seconds", "time between tokens", LATENCY_BUCKETS_S, TAGS)
        self.e2e = Histogram("pegaserve_e2e_latency_seconds", "request latency", LATENCY_BUCKETS_S, TAGS)
        self.prompt_tokens = Counter("pegaserve_prompt_tokens_total", "prompt tokens", TAGS)
        self.completion_tokens = Counter("pegaserve_completion_tokens_total", "completion tokens", TAGS)
        self.finished_requests = Counter(
            "pegaserve_requests_finished_total", "finished requests", (*TAGS, "stop_cause", "finish_reason")
        )
        for metric in (self.ttft, self.itl, self.e2e, self.prompt_tokens, self.completion_tokens):
            metric.set_default_tags(self.tags)
        self.finished_requests.set_default_tags(self.tags)

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def tokens(self, num_tokens: int, seconds_since_last: float) -> None:
        if num_tokens:
            for _ in range(num_tokens):
                self.itl.observe(seconds_since_last / num_tokens)

    def finished(self, cause: StopCause, prompt_tokens: int, completion_tokens: int, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)
        self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.completion_tokens.inc(completion_tokens)
        self.finished_requests.inc(
            1, {"stop_cause": cause_kind(cause), "finish_reason": finish_reason(cause) or "none"}
        )


class EngineMetrics:
    """Queue depth, running requests and KV block usage of one replica."""

    def __init__(self, model: str, deployment: str, replica: str) -> None:
        tags = (*TAGS, "replica")
        self.tags = {"model": model, "deployment": deployment, "replica": replica}
        self.queue = Gauge("pegaserve_queue_depth", "requests waiting for an engine step", tags)
        self.running = Gauge("pegaserve_running_requests", "requests in the engine's batch", tags)
        self.blocks_used = Gauge("pegaserve_kv_blocks_used", "KV blocks in use", tags)
        self.blocks_total = Gauge("pegaserve_kv_blocks_total", "KV blocks in the pool", tags)
        for gauge in (self.queue, self.running, self.blocks_used, self.blocks_total):
            gauge.set_default_tags(self.tags)

    def update(self, stats: EngineStats) -> None:
        self.queue.set(stats.num_waiting)
        self.running.set(stats.num_running + stats.num_parked)
        self.blocks_used.set(stats.num_blocks - stats.num_free_blocks)
        self.blocks_total.set(stats.num_blocks)


class TransferMetrics:
    """KV handoff bytes and seconds by transport, and fallbacks to recompute."""

    def __init__(self, model: str, deployment: str) -> None:
        tags = (*TAGS, "transport")
        self.base = {"model": model, "deployment": deployment}
        self.bytes = Counter("pegaserve_kv_transfer_bytes_total", "KV bytes moved prefill -> decode", tags)
        self.seconds = Histogram("pegaserve_kv_transfer_seconds", "KV transfer time", LATENCY_BUCKETS_S, tags)
        self.fallbacks = Counter("pegaserve_kv_fallbacks_total", "decode recomputed the prompt", tags)
        self.cached_bytes = Counter("pegaserve_kv_transfer_cached_bytes_total",
                                    "prompt KV decode already held in its prefix cache (not moved)", tags)

    def transferred(self, transport: str, kv_bytes: int, seconds: float, cached_bytes: int = 0) -> None:
        tags = {**self.base, "transport": transport}
        if kv_bytes:
            self.bytes.inc(kv_bytes, tags)
        if cached_bytes:
            self.cached_bytes.inc(cached_bytes, tags)
        self.seconds.observe(seconds, tags)

    def fallback(self, transport: str) -> None:
        self.fallbacks.inc(1, {**self.base, "transport": transport})


class MigrationMetrics:
    """Requests that resumed on another replica after theirs failed mid-stream."""

    def __init__(self) -> None:
        self.migrations = Counter("pegaserve_migrations_total", "requests resumed on another replica", ())

    def migrated(self) -> None:
        self.migrations.inc()
