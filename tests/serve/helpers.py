"""Running pegaserve apps on a local Ray cluster inside the test process."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import httpx
import ray
import yaml
from ray import serve

from pegaserve.deployments.colocated import Colocated
from pegaserve.deployments.config import AppArgs
from pegaserve.deployments.decode import Decode
from pegaserve.deployments.ingress import Ingress
from pegaserve.deployments.prefill import Prefill
from pegaserve.testing.hook import as_env

HTTP_PORT = 8123  # not 8000: a developer's `make serve` may be running
METRICS_PORT = 8124
BASE = f"http://127.0.0.1:{HTTP_PORT}"
SMALL = {"num_cpus": 0.1}
JOURNAL = str(Path(tempfile.mkdtemp(prefix="pegaserve-test-")) / "ledger.jsonl")
CLUSTER_YAML = Path(__file__).parents[2] / "configs" / "cluster.yaml"


def cluster_limits() -> dict[str, int]:
    """configs/cluster.yaml's max_ongoing_requests per deployment (Serve's default of 5 per replica
    would queue the rest of a test's concurrent requests before they reach a decode replica)."""
    (app,) = yaml.safe_load(CLUSTER_YAML.read_text())["applications"]
    return {d["name"]: d["max_ongoing_requests"] for d in app["deployments"]}


def start_ray(**init_kwargs) -> None:
    if not ray.is_initialized():
        ray.init(num_cpus=16, include_dashboard=False, log_to_driver=False, _metrics_export_port=METRICS_PORT,
                 **init_kwargs)
    serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})


def deploy(name: str, args: dict, num_prefill: int = 1, num_decode: int = 1, actor_options: dict = SMALL,
           prefill_options: dict | None = None, decode_options: dict | None = None,
           doubles: dict | None = None) -> str:
    """Deploy one pegaserve app at /<name>; returns its base URL. `doubles` (the keywords of
    `pegaserve.testing.hook.as_env`) puts test doubles into the engine replicas."""
    plain = AppArgs.model_validate({"ledger_journal": JOURNAL, **args}).model_dump(mode="json")
    limits = cluster_limits()
    ingress = Ingress.options(ray_actor_options=actor_options, max_ongoing_requests=limits["Ingress"])

    def engine_options(options: dict | None) -> dict:
        options = dict(options or actor_options)
        if doubles is not None:
            options["runtime_env"] = {"env_vars": as_env(**doubles)}
        return options

    if plain["mode"] == "colocated":
        colocated = Colocated.options(ray_actor_options=engine_options(None),
                                      max_ongoing_requests=limits["Decode"])  # it decodes: Decode's limit
        app = ingress.bind(plain, colocated=colocated.bind(plain))
    else:
        prefill = Prefill.options(num_replicas=num_prefill, ray_actor_options=engine_options(prefill_options),
                                  max_ongoing_requests=limits["Prefill"])
        decode = Decode.options(num_replicas=num_decode, ray_actor_options=engine_options(decode_options),
                                max_ongoing_requests=limits["Decode"])
        app = ingress.bind(plain, prefill=prefill.bind(plain), decode=decode.bind(plain))
    serve.run(app, name=name, route_prefix=f"/{name}")
    url = f"{BASE}/{name}"
    wait_healthy(url)
    return url


def wait_healthy(url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s}s")


def wait_for_idle_pools(url: str, replicas: int, timeout_s: float = 30) -> dict:
    """Engine stats of every replica once all KV blocks are back in their pools."""
    deadline = time.monotonic() + timeout_s
    stats: dict = {}
    while time.monotonic() < deadline:
        stats = httpx.get(f"{url}/admin/stats").json()
        if len(stats) >= replicas and all(
            s["num_free_blocks"] == s["num_blocks"] and s["num_running"] == 0 and s["num_parked"] == 0
            for s in stats.values()
        ):
            return stats
        time.sleep(0.5)
    raise AssertionError(f"KV blocks not all back in their pools: {stats}")
