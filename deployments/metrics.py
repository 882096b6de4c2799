"""pegaserve's Ray metrics (`pegaserve_*`), exported on each Ray node's Prometheus endpoint (with Ray's
`ray_` prefix) and shown by configs/grafana-pegaserve.json.

Every metric is tagged `model` and `deployment`. `model` is the served name — what clients put in
`"model"` (`served_name(args.model)`: `qwen3-tiny`, or a checkpoint directory's last component), never
the path — so the dashboard's `$model` variable matches every panel whatever checkpoint is served.

Every counter's known series exist at 0 from the moment its metrics object is built. Ray exports a
counter's series only from its first record on, and `Counter.inc` refuses 0: a rare event (a fallback,
an abort, an error, a migration) would otherwise be born as a series already at 1, and `rate()` of a
series' first sample is nothing, so its first occurrence would never show."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray.util.metrics import Counter, Gauge, Histogram

from pegaserve.api.guards import route_path
from pegaserve.api.observer import RequestObserver
from pegaserve.messages import EngineStats
from pegaserve.stop import Abort, Eos, Error, Length, StopCause, String, Token, cause_kind, finish_reason

# Fine at the low end for inter-token latency (a few ms), up to 120 s: above any timeout a request
# meets on its way (transfer 30 s, lease 60 s), so the top bucket is latency, not a timeout.
LATENCY_BUCKETS_S = [0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                     0.25, 0.5, 0.75, 1, 1.5, 2.5, 5, 7.5, 10, 15, 20, 30, 45, 60, 90, 120]
TAGS = ("model", "deployment")
ITL_BATCH = 256  # inter-token gaps held before they go into the histogram (also at each finish)
EVERY_CAUSE: tuple[StopCause, ...] = (Eos(0), Token(0), String(""), Length(), Abort(), Error(""))


def zero(counter: Counter, tags: Mapping[str, str] | None = None) -> None:
    """Export `counter`'s series for `tags` (over its default tags) at 0 now, before its first event.
    `_record` is what `Counter.inc` calls once it has checked that the value is positive (Ray 2.60)."""
    counter._record(0, dict(tags or {}))


def counter(name: str, description: str, tags: Mapping[str, str], extra_keys: tuple[str, ...] = ()) -> Counter:
    """A counter with `tags` as its default tags, its series for those tags at 0 unless `extra_keys`
    (then the caller zeroes each known combination)."""
    metric = Counter(name, description, (*tags, *extra_keys))
    metric.set_default_tags(dict(tags))
    if not extra_keys:
        zero(metric)
    return metric


def finish_tags(cause: StopCause) -> dict[str, str]:
    return {"stop_cause": cause_kind(cause), "finish_reason": finish_reason(cause) or "none"}


class IngressMetrics(RequestObserver):
    """Latency and token counts as the client saw them. `model` is the served name."""

    def __init__(self, model: str, deployment: str = "Ingress") -> None:
        self.tags = {"model": model, "deployment": deployment}
        self._gaps_s: list[float] = []  # inter-token gaps not yet in `itl`
        self.ttft = Histogram("pegaserve_ttft_seconds", "time to first token", LATENCY_BUCKETS_S, TAGS)
        self.itl = Histogram("pegaserve_inter_token_latency_seconds", "time between tokens", LATENCY_BUCKETS_S, TAGS)
        self.e2e = Histogram("pegaserve_e2e_latency_seconds", "request latency", LATENCY_BUCKETS_S, TAGS)
        for histogram in (self.ttft, self.itl, self.e2e):
            histogram.set_default_tags(self.tags)
        self.prompt_tokens = counter("pegaserve_prompt_tokens_total", "prompt tokens", self.tags)
        self.completion_tokens = counter("pegaserve_completion_tokens_total", "completion tokens", self.tags)
        self.finished_requests = counter("pegaserve_requests_finished_total", "finished requests", self.tags,
                                         ("stop_cause", "finish_reason"))
        for cause in EVERY_CAUSE:
            zero(self.finished_requests, finish_tags(cause))

    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def tokens(self, num_tokens: int, seconds_since_last: float) -> None:
        if num_tokens:  # (a delta may bring text or a finish alone)
            self._gaps_s += [seconds_since_last / num_tokens] * num_tokens
        if len(self._gaps_s) >= ITL_BATCH:
            self._observe_gaps()

    def _observe_gaps(self) -> None:
        """The gaps kept so far, into the histogram in one go. There is one per token, and a Ray
        metric record amid the replica's work costs ~4x what it costs in a row (measured in the
        ingress under load: ~18 us against ~4.5 us)."""
        gaps_s, self._gaps_s = self._gaps_s, []
        for gap_s in gaps_s:
            self.itl.observe(gap_s)

    def finished(self, cause: StopCause, prompt_tokens: int, completion_tokens: int, e2e_s: float) -> None:
        self._observe_gaps()
        self.e2e.observe(e2e_s)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if completion_tokens:
            self.completion_tokens.inc(completion_tokens)
        self.finished_requests.inc(1, finish_tags(cause))


class EngineTotal:
    """A Ray counter fed from one of the engine's running totals (`EngineStats` counts since the
    engine started): each update adds what the total grew by."""

    def __init__(self, name: str, description: str, tags: Mapping[str, str]) -> None:
        self.counter = counter(name, description, tags)
        self.total = 0

    def advance(self, total: int) -> None:
        # A restarted engine process counts from 0 again: all of its total is new.
        grown = total - self.total if total >= self.total else total
        if grown > 0:
            self.counter.inc(grown)
        self.total = total


class EngineMetrics:
    """One replica's load (waiting and running requests, KV leases, KV blocks) and its engine's
    totals (preemptions, prefix-cache lookups, speculative drafts). `model` is the served name."""

    def __init__(self, model: str, deployment: str, replica: str) -> None:
        self.tags = {"model": model, "deployment": deployment, "replica": replica}
        keys = tuple(self.tags)
        self.queue = Gauge("pegaserve_queue_depth", "requests waiting to be scheduled", keys)
        self.running = Gauge("pegaserve_running_requests", "requests in the engine's batch", keys)
        self.leases = Gauge("pegaserve_kv_leases", "requests whose KV is held for a handoff: parked on "
                            "prefill until decode fetches it, or being received on decode", (*keys, "state"))
        self.blocks_used = Gauge("pegaserve_kv_blocks_used", "KV blocks in use", keys)
        self.blocks_total = Gauge("pegaserve_kv_blocks_total", "KV blocks in the pool", keys)
        self.blocks_cached = Gauge("pegaserve_kv_blocks_cached", "KV blocks holding a cached prefix", keys)
        for gauge in (self.queue, self.running, self.leases, self.blocks_used, self.blocks_total, self.blocks_cached):
            gauge.set_default_tags(self.tags)
        self.preemptions = EngineTotal("pegaserve_preemptions_total", "requests preempted (recomputed later)",
                                       self.tags)
        self.prefix_queried = EngineTotal("pegaserve_prefix_cache_queried_tokens_total",
                                          "prompt tokens looked up in the prefix cache", self.tags)
        self.prefix_hits = EngineTotal("pegaserve_prefix_cache_hit_tokens_total",
                                       "prompt tokens found in the prefix cache", self.tags)
        self.draft_tokens = EngineTotal("pegaserve_spec_draft_tokens_total", "speculative draft tokens verified",
                                        self.tags)
        self.accepted_tokens = EngineTotal("pegaserve_spec_accepted_tokens_total",
                                           "speculative draft tokens accepted", self.tags)
        self.spec_steps = EngineTotal("pegaserve_spec_steps_total", "request-steps that verified drafts", self.tags)
        self.spec_emitted_tokens = EngineTotal("pegaserve_spec_emitted_tokens_total",
                                               "tokens those steps produced (accepted + one sampled)", self.tags)

    def update(self, stats: EngineStats) -> None:
        self.queue.set(stats.num_waiting)
        self.running.set(stats.num_running)
        self.leases.set(stats.num_parked, {"state": "parked"})
        self.leases.set(stats.num_receiving, {"state": "receiving"})
        self.blocks_used.set(stats.num_blocks - stats.num_free_blocks)
        self.blocks_total.set(stats.num_blocks)
        self.blocks_cached.set(stats.num_cached_blocks)
        self.preemptions.advance(stats.num_preemptions)
        self.prefix_queried.advance(stats.prefix_cache_queried_tokens)
        self.prefix_hits.advance(stats.prefix_cache_hit_tokens)
        self.draft_tokens.advance(stats.num_draft_tokens)
        self.accepted_tokens.advance(stats.num_accepted_tokens)
        self.spec_steps.advance(stats.num_spec_steps)
        self.spec_emitted_tokens.advance(stats.num_spec_emitted_tokens)


class TransferMetrics:
    """KV handoff bytes and seconds by transport, and fallbacks to recompute. `model` is the served
    name; `transports` are those whose series start at 0 (the configured one's `KvTransport.names`)."""

    def __init__(self, model: str, deployment: str, transports: Sequence[str]) -> None:
        self.base = {"model": model, "deployment": deployment}
        self.bytes = counter("pegaserve_kv_transfer_bytes_total", "KV bytes moved prefill -> decode", self.base,
                             ("transport",))
        self.seconds = Histogram("pegaserve_kv_transfer_seconds", "KV transfer time", LATENCY_BUCKETS_S,
                                 (*TAGS, "transport"))
        self.seconds.set_default_tags(self.base)
        self.fallbacks = counter("pegaserve_kv_fallbacks_total", "decode recomputed the prompt", self.base,
                                 ("transport",))
        self.cached_bytes = counter("pegaserve_kv_transfer_cached_bytes_total",
                                    "prompt KV decode already held in its prefix cache (not moved)", self.base,
                                    ("transport",))
        for transport in transports:
            for metric in (self.bytes, self.fallbacks, self.cached_bytes):
                zero(metric, {"transport": transport})

    def transferred(self, transport: str, kv_bytes: int, seconds: float, cached_bytes: int = 0) -> None:
        tags = {"transport": transport}
        if kv_bytes:
            self.bytes.inc(kv_bytes, tags)
        if cached_bytes:
            self.cached_bytes.inc(cached_bytes, tags)
        self.seconds.observe(seconds, tags)

    def fallback(self, transport: str) -> None:
        self.fallbacks.inc(1, {"transport": transport})


class MigrationMetrics:
    """Requests that resumed on another replica after theirs failed mid-stream. `model` is the served
    name."""

    def __init__(self, model: str, deployment: str = "Ingress") -> None:
        self.migrations = counter("pegaserve_migrations_total", "requests resumed on another replica",
                                  {"model": model, "deployment": deployment})

    def migrated(self) -> None:
        self.migrations.inc()


# --- HTTP responses --------------------------------------------------------------------------------

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Asgi = Callable[[Scope, Receive, Send], Awaitable[None]]

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/admin", "other")
STATUSES = ("2xx", "3xx", "400", "401", "404", "413", "429", "4xx", "499", "5xx")
CLIENT_CLOSED = 499  # nginx's code: the client went away before the response ended
NAMED_CODES = frozenset({400, 401, 404, 413, 429, CLIENT_CLOSED})


def status_class(code: int) -> str:
    """The codes pegaserve answers on purpose by themselves, the rest by class (unknown ones: 5xx)."""
    if code in NAMED_CODES:
        return str(code)
    if 200 <= code < 500:
        return f"{code // 100}xx"
    return "5xx"


def endpoint_of(scope: Scope) -> str:
    """The route a request went to, from a fixed set (an id in the path never makes a new series)."""
    path = route_path(scope).rstrip("/")
    for endpoint in ENDPOINTS:
        if path == endpoint or path.startswith(endpoint + "/"):
            return endpoint
    return "other"


@dataclass
class ResponseProgress:
    """What one request's response got to; only its middleware call changes it."""

    status: int | None = None  # from http.response.start
    complete: bool = False  # the last body chunk went out
    disconnected: bool = False  # the app was told the client went away

    def outcome(self) -> int:
        """The status to count once the app returned or raised: an unfinished response is the
        client's doing when it went away, else the server's."""
        if self.complete and self.status is not None:
            return self.status
        return CLIENT_CLOSED if self.disconnected else 500


class HttpStatusMetrics:
    """Pure ASGI middleware counting every HTTP response in `pegaserve_http_responses_total` by
    endpoint and status (`status_class`); a response the client abandoned before its end (a
    disconnect, or a cancelled request) counts as 499. `model` is the served name.

    `HttpStatusMetrics(app, model)` wraps `app` (or `fastapi_app.add_middleware(HttpStatusMetrics,
    model=...)`, outermost when added last); every endpoint x status series starts at 0."""

    def __init__(self, app: Asgi, model: str, deployment: str = "Ingress") -> None:
        self.app = app
        self.responses = counter("pegaserve_http_responses_total", "HTTP responses by endpoint and status",
                                 {"model": model, "deployment": deployment}, ("endpoint", "status"))
        for endpoint in ENDPOINTS:
            for status in STATUSES:
                zero(self.responses, {"endpoint": endpoint, "status": status})

    def __getattr__(self, name: str) -> Any:
        # Wrapped directly, it stays transparent: Serve configures the app it is handed (it installs
        # its back-pressure exception handlers through `add_exception_handler`).
        if name == "app":
            raise AttributeError(name)
        return getattr(self.app, name)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        progress = ResponseProgress()

        async def watched_receive() -> Message:
            try:
                message = await receive()
            except BaseException:
                # Serve's receive raises (TaskCancelledError) once its proxy dropped the request for
                # a client that went away.
                progress.disconnected = True
                raise
            if message["type"] == "http.disconnect":
                progress.disconnected = True
            return message

        async def watched_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                progress.status = message["status"]
            try:
                await send(message)
            except BaseException:
                progress.disconnected = True  # the connection is gone, whatever the app makes of it
                raise
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                progress.complete = True

        try:
            await self.app(scope, watched_receive, watched_send)
        except BaseException as failure:
            # Serve cancels a request whose client went away.
            progress.disconnected |= isinstance(failure, asyncio.CancelledError)
            self.count(scope, progress.outcome())
            raise
        self.count(scope, progress.outcome())

    def count(self, scope: Scope, code: int) -> None:
        self.responses.inc(1, {"endpoint": endpoint_of(scope), "status": status_class(code)})
