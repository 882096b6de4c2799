"""Where the CPU goes during a benchmark level: this process and every process it started (the
Ray cluster's raylet, GCS, Serve proxy and controller, replicas, actors), grouped by role, plus the
machine's busy time from /proc/stat — what other users of the machine took shows as `others`.

On a 2-core box a serving system's throughput is bounded by CPU, so CPU-seconds per output token
by component is the profile that says where the time goes.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from dataclasses import dataclass

import psutil

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU-seconds the whole machine spent busy since boot (all cores)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / _CLK_TCK


def _label(process: psutil.Process) -> str:
    """`ServeReplica:pd:Decode`, `ProxyActor`, `raylet`, ... (Ray renames workers per task)."""
    try:
        cmdline = process.cmdline()
    except psutil.Error:
        return "gone"
    first = cmdline[0] if cmdline else process.name()
    if first.startswith("ray::"):
        name = first.removeprefix("ray::").split(".")[0].split(" ")[0]
        return name if name != "IDLE" else "ray worker (idle)"
    if process.pid == os.getpid():
        return "driver (bench client)"
    base = os.path.basename(first)
    if base.startswith("python"):
        if "-m" in cmdline[1:-1]:  # `python -m pegaserve.engine.process ...`: the module
            return cmdline[cmdline.index("-m", 1) + 1]
        script = next((os.path.basename(a) for a in cmdline[1:] if a.endswith(".py")), base)
        return re.sub(r"\.py$", "", script)
    return base


def _snapshot() -> dict[int, tuple[str, float]]:
    me = psutil.Process()
    snapshot = {}
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
            snapshot[process.pid] = (_label(process), times.user + times.system)
        except psutil.Error:
            continue
    return snapshot


@dataclass(frozen=True)
class CpuUsage:
    wall_s: float
    by_component_s: dict[str, float]  # CPU-seconds per role, this process tree only
    machine_busy_s: float  # CPU-seconds the machine was busy (all processes)

    @property
    def ours_s(self) -> float:
        return sum(self.by_component_s.values())

    @property
    def others_s(self) -> float:
        """What processes outside this benchmark used meanwhile (other users of the machine)."""
        return max(0.0, self.machine_busy_s - self.ours_s)


class CpuMeter:
    """`start()` then `stop(wall_s)`; processes born in between count from zero."""

    def __init__(self) -> None:
        self._before: dict[int, tuple[str, float]] = {}
        self._busy_before = 0.0

    def start(self) -> None:
        self._before = _snapshot()
        self._busy_before = _machine_busy_s()

    def stop(self, wall_s: float) -> CpuUsage:
        after = _snapshot()
        busy = _machine_busy_s() - self._busy_before
        by_component: Counter[str] = Counter()
        for pid, (label, cpu_s) in after.items():
            before = self._before.get(pid)
            by_component[label] += cpu_s - (before[1] if before else 0.0)
        return CpuUsage(wall_s, {k: v for k, v in by_component.most_common() if v > 0.005}, busy)


def idle_rates(sample_s: float) -> dict[str, float]:
    """CPU-seconds per second each component of this process tree spends with no load on it."""
    meter = CpuMeter()
    meter.start()
    time.sleep(sample_s)
    return {label: cpu_s / sample_s for label, cpu_s in meter.stop(sample_s).by_component_s.items()}


def during_load(usage: CpuUsage, load_s: float, idle_per_s: dict[str, float]) -> dict[str, float]:
    """`usage`'s CPU-seconds per component less what the component spends idle over the part of
    the window without load (`usage.wall_s - load_s`: a client starting up and reporting)."""
    idle_s = max(0.0, usage.wall_s - load_s)
    return {label: max(0.0, cpu_s - idle_per_s.get(label, 0.0) * idle_s)
            for label, cpu_s in usage.by_component_s.items()}


def others_cores(sample_s: float = 1.0) -> float:
    """Cores that processes outside this benchmark kept busy over the next `sample_s`."""
    meter = CpuMeter()
    meter.start()
    time.sleep(sample_s)
    return meter.stop(sample_s).others_s / sample_s


class QuietGate:
    """Before a level, wait (bounded: per call and over the whole run) until other users of the
    machine leave it nearly idle; a shared 2-core box otherwise measures its neighbours."""

    def __init__(self, threshold_cores: float = 0.5, max_wait_s: float = 20.0, total_wait_s: float = 120.0) -> None:
        self.threshold_cores = threshold_cores
        self.max_wait_s = max_wait_s
        self.left_s = total_wait_s

    def wait(self) -> float:
        """Seconds waited (the last sample is the level's starting point)."""
        start = time.monotonic()
        limit = min(self.max_wait_s, self.left_s)
        while others_cores() > self.threshold_cores and time.monotonic() - start < limit:
            pass
        waited = time.monotonic() - start
        self.left_s = max(0.0, self.left_s - waited)
        return waited
