"""A pegaserve app on a private, in-process Ray cluster, for the benchmarks (127.0.0.1 only).

`LocalServe` starts Ray and Serve in this process, deploys one app at a time at its own route
prefix, and stops everything it started when the `with` block ends. Replica options mirror
configs/cluster.yaml (Ingress 0.25 CPU, Prefill/Decode/Colocated 0.5 CPU each), so each engine
runs torch on one thread, as under `make serve`.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass, field

import httpx

HOST = "127.0.0.1"
LOGICAL_CPUS = 8  # Ray's bookkeeping only; the replicas ask for fractions of a CPU
INGRESS_OPTIONS = {"num_cpus": 0.25}
ENGINE_OPTIONS = {"num_cpus": 0.5}
HEALTH_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout_s:.0f}s")


@dataclass
class LocalServe:
    """Ray + Serve on 127.0.0.1:`port` (0: any free port), torn down on exit."""

    port: int = 0
    deployed: list[str] = field(default_factory=list)

    def _engine_options(self) -> dict:
        return ENGINE_OPTIONS  # each engine's torch threads: the app's `engine.torch_threads`

    def __enter__(self) -> LocalServe:
        import os  # noqa: PLC0415

        from pegaserve.deployments.env import SERVE_ENV  # noqa: PLC0415 - Serve as `make serve` runs it

        for key, value in SERVE_ENV.items():  # before Ray Serve is imported: it reads them once
            os.environ.setdefault(key, value)
        os.environ.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "1")  # deleting an app
        os.environ.setdefault("RAY_SERVE_HAPROXY_METRICS_PORT", str(free_port()))  # beside a `make serve`
        os.environ.setdefault("RAY_SERVE_HAPROXY_STATS_PORT", str(free_port()))
        import ray  # noqa: PLC0415 - keep `--help` and the transformers-only runs light
        from ray import serve  # noqa: PLC0415

        if ray.is_initialized():
            raise RuntimeError("Ray is already initialized in this process; the benchmark starts its own")
        self.port = self.port or free_port()
        ray.init(num_cpus=LOGICAL_CPUS, include_dashboard=False, log_to_driver=False, configure_logging=False)
        serve.start(http_options={"host": HOST, "port": self.port})
        return self

    def __exit__(self, *exc) -> None:
        import ray  # noqa: PLC0415
        from ray import serve  # noqa: PLC0415

        try:
            serve.shutdown()
        finally:
            ray.shutdown()

    def deploy(self, name: str, args: dict, num_prefill: int = 1, num_decode: int = 1) -> str:
        """Deploy the pegaserve app `args` (deployments/config.py `AppArgs`) at /`name`; its URL."""
        from ray import serve  # noqa: PLC0415

        from pegaserve.deployments.colocated import Colocated  # noqa: PLC0415
        from pegaserve.deployments.config import AppArgs  # noqa: PLC0415
        from pegaserve.deployments.decode import Decode  # noqa: PLC0415
        from pegaserve.deployments.ingress import Ingress  # noqa: PLC0415
        from pegaserve.deployments.prefill import Prefill  # noqa: PLC0415

        plain = AppArgs.model_validate(args).model_dump(mode="json")
        ingress = Ingress.options(ray_actor_options=INGRESS_OPTIONS, max_ongoing_requests=256)
        if plain["mode"] == "colocated":
            app = ingress.bind(plain, colocated=Colocated.options(
                ray_actor_options=self._engine_options(), max_ongoing_requests=128).bind(plain))
        else:
            prefill = Prefill.options(num_replicas=num_prefill, ray_actor_options=self._engine_options(),
                                      max_ongoing_requests=128)
            decode = Decode.options(num_replicas=num_decode, ray_actor_options=self._engine_options(),
                                    max_ongoing_requests=128)
            app = ingress.bind(plain, prefill=prefill.bind(plain), decode=decode.bind(plain))
        serve.run(app, name=name, route_prefix=f"/{name}")
        self.deployed.append(name)
        url = f"http://{HOST}:{self.port}/{name}"
        wait_healthy(url)
        return url

    def delete(self, name: str) -> None:
        """Remove an app, so the next one has the CPUs to itself."""
        from ray import serve  # noqa: PLC0415

        serve.delete(name)
        self.deployed.remove(name)
