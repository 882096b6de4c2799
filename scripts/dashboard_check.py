"""Check configs/grafana-pegaserve.json against a real Prometheus scraping a running pegaserve.

Starts Prometheus on 127.0.0.1 with Ray's service-discovery file (targets rewritten to 127.0.0.1),
sends a little traffic to pegaserve (clean requests, a 400, a 404, a stream the client abandons),
then runs every query of the dashboard through Prometheus's HTTP API, with the dashboard's
variables filled in as Grafana would. Fails when a query is invalid, uses a hard-coded window
instead of `$__rate_interval`, or (unless listed in MAY_BE_EMPTY) returns no data after the
traffic; when a `ray_pegaserve_*` series lacks the served model name; or when a `ray_pegaserve_*`
family is on no panel. Stops Prometheus and removes its files whatever happens.

    python scripts/dashboard_check.py [--url http://127.0.0.1:8000] [--sd-file ...] [--prometheus BIN]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import signal
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prometheus_process import PrometheusProcess

REPO = Path(__file__).resolve().parent.parent
RAY_EXPORT_S = 11  # Ray's workers export their metrics every 10 s (metrics_report_interval_ms)
RATE_INTERVAL = "1m"  # what Grafana's $__rate_interval is for a 5 s scrape and a short time range
HARD_CODED_WINDOW = re.compile(r"\[\d+[smhdwy]\]|offset \d+[smhdwy]")

# Targets that may have no data after this check's traffic: (panel title, legend) -> why.
MAY_BE_EMPTY = {
    ("Replica starts and health-check failures (per window)", "failed health checks {{deployment}}"):
        "Serve's counter appears at the first failed health check",
    ("Speculative decoding: acceptance and tokens per step", "accepted / proposed {{deployment}}"):
        "0 / 0 unless `speculative` is configured",
    ("Speculative decoding: acceptance and tokens per step", "tokens per step {{deployment}}"):
        "0 / 0 unless `speculative` is configured",
}
# Counters every app exports at 0 from its replicas' start.
ZEROED_AT_START = ("ray_pegaserve_http_responses_total", "ray_pegaserve_requests_finished_total",
                   "ray_pegaserve_prompt_tokens_total", "ray_pegaserve_completion_tokens_total",
                   "ray_pegaserve_migrations_total", "ray_pegaserve_preemptions_total",
                   "ray_pegaserve_prefix_cache_queried_tokens_total", "ray_pegaserve_spec_draft_tokens_total")
# Events this check causes once each: a rate panel must show them (a counter born at 1 would not).
FIRST_EVENTS = {
    "abandoned stream": 'ray_pegaserve_http_responses_total{{model="{model}", status="499"}}',
    "400": 'ray_pegaserve_http_responses_total{{model="{model}", status="400"}}',
    "abort": 'ray_pegaserve_requests_finished_total{{model="{model}", stop_cause="abort"}}',
}
# Families only a P/D app exports (colocated has no KV handoff).
PD_ONLY = re.compile(r"ray_pegaserve_kv_(transfer|fallbacks)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the running pegaserve (loopback only)")
    parser.add_argument("--sd-file", default="/tmp/ray/prom_metrics_service_discovery.json",
                        help="Ray's Prometheus service-discovery file (the head node writes it)")
    parser.add_argument("--prometheus", default="prometheus", help="the Prometheus binary")
    parser.add_argument("--dashboard", default=str(REPO / "configs/grafana-pegaserve.json"))
    parser.add_argument("--api-key", default=None, help="when pegaserve has api_keys")
    parser.add_argument("--timeout-s", type=float, default=300, help="the whole check")
    args = parser.parse_args()
    if httpx.URL(args.url).host not in ("127.0.0.1", "localhost", "::1"):
        parser.error("--url must be on the loopback interface")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanups on a plain kill too
    deadline = time.monotonic() + args.timeout_s
    dashboard = json.loads(Path(args.dashboard).read_text())
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, headers=headers, timeout=60) as server:
        served = served_model(server)
        print(f"pegaserve at {args.url} serves {served!r}; Ray targets from {args.sd_file}")
        with PrometheusProcess(args.prometheus, Path(args.sd_file), scrape_interval_s=5) as prometheus:
            prom = httpx.Client(base_url=prometheus.url, timeout=30)
            warm_up(server, served)
            prometheus.wait_scraped(prom, deadline, scrapes=2)
            time.sleep(RAY_EXPORT_S)
            wait_for_zeros(prom, served, min(deadline, time.monotonic() + 60))
            started = time.time()
            send_traffic(server, served)
            wait_for_events(prom, served, deadline)
            return check_dashboard(prom, dashboard, served, started)


def served_model(server: httpx.Client) -> str:
    server.get("/health").raise_for_status()
    models = server.get("/v1/models")
    models.raise_for_status()
    return models.json()["data"][0]["id"]


def warm_up(server: httpx.Client, model: str) -> None:
    """One request before the baseline: a histogram's series are born at their first observation,
    so without a sample before the traffic its quantile panels would see no increase."""
    body = {"model": model, "prompt": "Hi", "max_tokens": 4, "ignore_eos": True}
    server.post("/v1/completions", json=body).raise_for_status()


def send_traffic(server: httpx.Client, model: str) -> None:
    """A handful of requests: each outcome the failure panels show, none heavy."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    outcomes = {
        "completion": server.post("/v1/completions", json=body).status_code,
        "chat": server.post("/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}).status_code,
        "bad max_tokens": server.post("/v1/completions", json={**body, "max_tokens": -1}).status_code,
        "unknown model": server.post("/v1/completions", json={**body, "model": "no-such-model"}).status_code,
        "models": server.get("/v1/models").status_code,
        "stats": server.get("/admin/stats").status_code,
    }
    with server.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        outcomes["stream"] = stream.status_code
        for _ in stream.iter_lines():
            pass
    with server.stream("POST", "/v1/completions", json={**body, "max_tokens": 2048, "stream": True}) as stream:
        outcomes["abandoned stream"] = stream.status_code
        next(stream.iter_lines())  # the first chunk, then the client goes away
    print("traffic:", ", ".join(f"{name} {code}" for name, code in outcomes.items()))
    expected = {"completion": 200, "chat": 200, "bad max_tokens": 400, "unknown model": 404, "stream": 200,
                "abandoned stream": 200}
    wrong = {name: code for name, code in outcomes.items() if name in expected and code != expected[name]}
    if wrong:
        raise SystemExit(f"unexpected statuses {wrong} (expected {expected})")


def wait_for_zeros(prom: httpx.Client, model: str, deadline: float) -> None:
    """The counters a replica builds at 0 must be in Prometheus before any event: else a rate panel
    would miss the first one (and a family missing here is not wired in at all)."""
    missing = list(ZEROED_AT_START)
    while missing and time.monotonic() < deadline:
        missing = [name for name in missing if not instant(prom, f'{name}{{model="{model}"}}')]
        time.sleep(2)
    if missing:
        raise SystemExit(f"not exported before any traffic (for model={model!r}): {missing}")


def wait_for_events(prom: httpx.Client, model: str, deadline: float) -> None:
    """Until Prometheus has the abandoned stream (Ray exports every ~10 s), then one scrape more."""
    wanted = [f'ray_pegaserve_http_responses_total{{model="{model}", status="499"}} > 0',
              f'ray_pegaserve_requests_finished_total{{model="{model}", stop_cause="abort"}} > 0',
              f'ray_pegaserve_http_responses_total{{model="{model}", status="400"}} > 0']
    while time.monotonic() < deadline:
        if all(instant(prom, query) for query in wanted):
            time.sleep(12)
            return
        time.sleep(3)
    missing = [query for query in wanted if not instant(prom, query)]
    raise SystemExit(f"these never reached Prometheus: {missing}")


def instant(prom: httpx.Client, query: str) -> list:
    answer = prom.get("/api/v1/query", params={"query": query}).json()
    if answer["status"] != "success":
        raise SystemExit(f"{query}: {answer.get('error')}")
    return answer["data"]["result"]


def check_dashboard(prom: httpx.Client, dashboard: dict, model: str, started: float) -> int:
    variables = fill_variables(prom, dashboard, model)
    pd = bool(instant(prom, 'ray_serve_deployment_status{deployment="Decode"}'))
    failures: list[str] = []
    queried: list[str] = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr, legend = target["expr"], target.get("legendFormat", "")
            queried.append(expr)
            if HARD_CODED_WINDOW.search(expr):
                failures.append(f"{panel['title']} / {legend}: a hard-coded window, not $__rate_interval")
            answer = prom.get("/api/v1/query_range", params={
                "query": expand(expr, variables), "start": started - 60, "end": time.time(), "step": 5}).json()
            if answer["status"] != "success":
                failures.append(f"{panel['title']} / {legend}: invalid query: {answer.get('error')}")
                continue
            series = [s for s in answer["data"]["result"] if any(not math.isnan(float(v)) for _, v in s["values"])]
            excused = MAY_BE_EMPTY.get((panel["title"], legend)) or (
                None if pd or not PD_ONLY.search(expr) else "a colocated app has no KV handoff")
            verdict = f"{len(series)} series" if series else f"EMPTY ({excused})" if excused else "EMPTY"
            print(f"  {panel['title'][:52]:52} {legend[:40]:40} {verdict}")
            if not series and not excused:
                failures.append(f"{panel['title']} / {legend}: no data after the traffic")
    failures += check_families(prom, model, " ".join(queried))
    for name, selector in FIRST_EVENTS.items():
        query = (f"max_over_time((sum(rate({selector.format(model=model)}[{RATE_INTERVAL}])))"
                 f"[{int(time.time() - started) + 60}s:5s]) > 0")
        if not instant(prom, query):
            failures.append(f"the check's {name} never showed on its rate panel")
    print("responses counted:", ", ".join(
        f"{s['metric']['endpoint']} {s['metric']['status']}: {float(s['value'][1]):.0f}" for s in
        instant(prom, f'sum by (endpoint, status) (ray_pegaserve_http_responses_total{{model="{model}"}}) > 0')))
    for failure in failures:
        print("FAIL", failure)
    print("dashboard check:", "failed" if failures else "passed",
          f"({sum(len(p.get('targets', [])) for p in dashboard['panels'])} queries)")
    return 1 if failures else 0


def fill_variables(prom: httpx.Client, dashboard: dict, model: str) -> dict[str, str]:
    """The dashboard's query variables as Grafana would fill them: each must list something, and
    `model` must list the served name (the path would match no panel)."""
    values = {"__rate_interval": RATE_INTERVAL}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        metric, label = re.fullmatch(r"label_values\((\w+), *(\w+)\)", variable["query"]).groups()
        found = prom.get(f"/api/v1/label/{label}/values", params={"match[]": metric}).json()["data"]
        if not found:
            raise SystemExit(f"the ${variable['name']} variable ({variable['query']}) lists nothing")
        if variable["name"] == "model" and model not in found:
            raise SystemExit(f"the $model variable lists {found}, not the served name {model!r}")
        chosen = [model] if variable["name"] == "model" else found
        values[variable["name"]] = "|".join(grafana_regex_escape(value) for value in chosen)
    return values


def grafana_regex_escape(value: str) -> str:
    """As Grafana escapes a multi-value variable for a Prometheus regex: a doubled backslash (one
    for the PromQL string, one for the regex) before each regex metacharacter."""
    return re.sub(r"([\\^$.|?*+()\[\]{}])", r"\\\\\1", value)


def expand(expr: str, variables: dict[str, str]) -> str:
    for name in sorted(variables, key=len, reverse=True):
        expr = expr.replace(f"${{{name}}}", variables[name]).replace(f"${name}", variables[name])
    return expr


def check_families(prom: httpx.Client, model: str, queries: str) -> list[str]:
    """Every pegaserve family carries the served name and is on some panel."""
    failures = []
    for series in instant(prom, f'count by (__name__, model) ({{__name__=~"ray_pegaserve_.*", model!="{model}"}})'):
        failures.append(f"{series['metric']['__name__']} is tagged model={series['metric'].get('model')!r}, "
                        f"not the served name {model!r}")
    names = prom.get("/api/v1/label/__name__/values", params={"match[]": '{__name__=~"ray_pegaserve_.*"}'}).json()
    for name in names["data"]:
        family = re.sub(r"_(bucket|count|sum)$", "", name)
        if family not in queries:
            failures.append(f"{name} is on no panel")
    return failures


if __name__ == "__main__":
    sys.exit(main())
