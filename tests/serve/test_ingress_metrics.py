"""The ingress's latency metrics: every inter-token gap reaches the histogram, in batches."""

from pegaserve.deployments.metrics import ITL_BATCH, IngressMetrics
from pegaserve.stop import Length


def _recorded(metrics: IngressMetrics) -> list[float]:
    seen: list[float] = []
    metrics.itl.observe = seen.append  # the instance's, over Ray's
    return seen


def test_every_gap_is_observed_by_the_request_s_finish():
    metrics = IngressMetrics("qwen3-tiny")
    seen = _recorded(metrics)
    metrics.tokens(1, 0.02)
    metrics.tokens(0, 0.01)  # a delta with text or a finish alone has no gap of its own
    metrics.tokens(2, 0.06)
    assert seen == []  # held: one Ray record per token costs most amid the replica's work
    metrics.finished(Length(), prompt_tokens=3, completion_tokens=3, e2e_s=0.1)
    assert seen == [0.02, 0.03, 0.03]


def test_gaps_go_in_once_a_batch_is_full():
    metrics = IngressMetrics("qwen3-tiny")
    seen = _recorded(metrics)
    for _ in range(ITL_BATCH - 1):
        metrics.tokens(1, 0.01)
    assert seen == []
    metrics.tokens(1, 0.01)
    assert len(seen) == ITL_BATCH
