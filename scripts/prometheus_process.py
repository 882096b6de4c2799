"""A throwaway Prometheus on 127.0.0.1 scraping the Ray nodes of a service-discovery file."""

from __future__ import annotations

import ctypes
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Self

import httpx

# Ray's file names each node by its address; on one machine every target is rewritten to the
# loopback interface, so nothing but 127.0.0.1 is contacted.
CONFIG = """\
global:
  scrape_interval: {interval}s
  evaluation_interval: {interval}s
scrape_configs:
  - job_name: ray
    file_sd_configs:
      - files: ['{sd_file}']
        refresh_interval: 10s
    relabel_configs:
      - source_labels: [__address__]
        regex: '.*:(\\d+)'
        replacement: '127.0.0.1:$1'
        target_label: __address__
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """Linux: the child gets SIGTERM if this process dies without cleaning up (a kill -9)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


class PrometheusProcess:
    """`with PrometheusProcess(binary, sd_file) as p:` Prometheus runs at `p.url` inside the block;
    it is stopped and its data directory removed on the way out."""

    def __init__(self, binary: str, sd_file: Path, scrape_interval_s: int = 5, ready_timeout_s: float = 60) -> None:
        if shutil.which(binary) is None:
            raise SystemExit(f"no Prometheus binary {binary!r} (Debian: apt-get install prometheus)")
        if not sd_file.exists():
            raise SystemExit(f"no Ray service-discovery file at {sd_file}: is Ray (make serve) running?")
        self.binary = binary
        self.sd_file = sd_file
        self.scrape_interval_s = scrape_interval_s
        self.ready_timeout_s = ready_timeout_s
        self.url = f"http://127.0.0.1:{free_port()}"
        self.workdir = Path(tempfile.mkdtemp(prefix="pegaserve-prometheus-"))
        self.process: subprocess.Popen | None = None
        self.log = None

    def __enter__(self) -> Self:
        config = self.workdir / "prometheus.yml"
        config.write_text(CONFIG.format(interval=self.scrape_interval_s, sd_file=self.sd_file))
        self.log = open(self.workdir / "prometheus.log", "w")
        self.process = subprocess.Popen(
            [self.binary, f"--config.file={config}", f"--storage.tsdb.path={self.workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)  # noqa: PLW1509 (no threads yet)
        try:
            self.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"Prometheus exited: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"Prometheus was not ready in {self.ready_timeout_s:.0f} s: {self.log_tail()}")

    def wait_scraped(self, client: httpx.Client, deadline: float, scrapes: int = 2) -> None:
        """Until every target has been tried and one answered, then `scrapes` scrape rounds more.
        A target that is down is reported, not waited for: besides each node's metrics port, Ray
        lists its autoscaler's and dashboard's, which another Ray on the machine may have taken."""
        targets: list[dict] = []
        while time.monotonic() < deadline:
            targets = client.get("/api/v1/targets").json()["data"]["activeTargets"]
            if targets and all(t["health"] != "unknown" for t in targets) and any(t["health"] == "up" for t in targets):
                for target in targets:
                    if target["health"] != "up":
                        print(f"note: {target['scrapeUrl']} is down ({target['lastError']})")
                time.sleep(scrapes * self.scrape_interval_s)
                return
            time.sleep(1)
        raise SystemExit(f"no Ray metrics target in {self.sd_file} answered: "
                         f"{[(t['scrapeUrl'], t['health'], t.get('lastError')) for t in targets]}")

    def log_tail(self) -> str:
        return (self.workdir / "prometheus.log").read_text()[-2000:]

    def __exit__(self, *_) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.log is not None:
            self.log.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
