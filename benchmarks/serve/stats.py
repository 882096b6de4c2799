"""Benchmark arithmetic: per-request timings, percentiles, the SLO, one summary row per level.

TTFT is from sending the request to the first chunk that carries a token. Inter-token latency
(ITL) is the gap between consecutive token-carrying chunks, split evenly over the tokens a chunk
carries. Output tokens/s is all output tokens of a level over its wall time (first send to last
byte). Goodput is the requests that met the SLO, per second of the same wall time.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Slo:
    """Per request: the first token within `ttft_s`, and its median inter-token gap within `itl_s`.

    1 s is where a wait starts to feel like one in an interactive UI; 100 ms per token (10
    tokens/s per stream) streams faster than people read (about 4-5 words/s)."""

    ttft_s: float = 1.0
    itl_s: float = 0.100

    def met_by(self, timing: RequestTiming) -> bool:
        itl = timing.median_itl_s
        return timing.ok and timing.ttft_s <= self.ttft_s and (itl is None or itl <= self.itl_s)

    def describe(self) -> str:
        return f"TTFT <= {self.ttft_s:g} s and the request's median ITL <= {self.itl_s * 1000:g} ms"


@dataclass
class RequestTiming:
    num_prompt_tokens: int
    start_s: float
    end_s: float = 0.0
    request_id: str | None = None
    error: str | None = None
    num_usage_tokens: int | None = None  # completion_tokens of the final usage chunk
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_num_tokens: list[int] = field(default_factory=list)

    def add_chunk(self, t_s: float, num_tokens: int) -> None:
        self.chunk_times_s.append(t_s)
        self.chunk_num_tokens.append(num_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.chunk_times_s)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.chunk_num_tokens)

    @property
    def ttft_s(self) -> float:
        return self.chunk_times_s[0] - self.start_s

    @property
    def itl_s(self) -> list[float]:
        gaps = []
        for prev, now, n in zip(self.chunk_times_s, self.chunk_times_s[1:], self.chunk_num_tokens[1:]):
            gaps += [(now - prev) / n] * n
        return gaps

    @property
    def median_itl_s(self) -> float | None:
        gaps = self.itl_s
        return statistics.median(gaps) if gaps else None


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class LevelSummary:
    system: str
    concurrency: int
    num_requests: int
    num_failed: int
    num_output_tokens: int
    wall_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    itl_p99_s: float
    output_tokens_per_s: float
    goodput_rps: float
    num_slo_met: int
    client_cpu_s: float | None = None  # None where there is no HTTP client (offline generate)
    load_avg_1m: float | None = None  # the machine's 1-minute load average after the level


def summarize(system: str, concurrency: int, timings: list[RequestTiming], wall_s: float, slo: Slo,
              client_cpu_s: float | None = None, load_avg_1m: float | None = None) -> LevelSummary:
    ok = [t for t in timings if t.ok]
    itl = [g for t in ok for g in t.itl_s]
    ttft = [t.ttft_s for t in ok]
    num_tokens = sum(t.num_output_tokens for t in ok)
    num_met = sum(slo.met_by(t) for t in ok)
    return LevelSummary(
        system=system, concurrency=concurrency, num_requests=len(timings), num_failed=len(timings) - len(ok),
        num_output_tokens=num_tokens, wall_s=wall_s,
        ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
        itl_p50_s=percentile(itl, 50), itl_p99_s=percentile(itl, 99),
        output_tokens_per_s=num_tokens / wall_s if wall_s > 0 else math.nan,
        goodput_rps=num_met / wall_s if wall_s > 0 else math.nan, num_slo_met=num_met,
        client_cpu_s=client_cpu_s, load_avg_1m=load_avg_1m,
    )  # fmt: skip
