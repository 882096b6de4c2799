"""What every benchmark report shares: the machine it ran on, and the hand-written notes kept
between `<!-- notes -->` and `<!-- /notes -->` when a report is rewritten."""

from __future__ import annotations

import os
import platform
import re
import statistics
import subprocess
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DOCS_DIR = REPO_ROOT / "docs" / "bench"  # where every report (.md) goes by default
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"  # where raw figures (.json) and plots (.png) go by default
NOTES_RE = re.compile(r"<!-- notes -->.*?<!-- /notes -->", re.S)
NOTES_PLACEHOLDER = "<!-- notes -->\n_(no notes yet)_\n<!-- /notes -->"


def machine() -> dict:
    """CPU model, usable cores, RAM, and the versions every report names."""
    cpu_model = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    with open("/proc/meminfo") as f:
        mem_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    import torch  # noqa: PLC0415

    return {"nproc": len(os.sched_getaffinity(0)), "cpu_model": cpu_model, "ram_gib": mem_kb / 2**20,
            "python": platform.python_version(), "torch": torch.__version__, "kernel": platform.release()}


def commit_text() -> str:
    """The checkout's short commit, saying so when tracked files differ from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, check=False).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return (git("rev-parse", "--short", "HEAD") or "an unknown commit") + (" (working tree modified)" if dirty else "")


def link(target: Path, report_dir: Path) -> str:
    """`target` as a report in `report_dir` links to it (docs/bench -> ../../benchmarks/results/X)."""
    return Path(os.path.relpath(target.resolve(), report_dir.resolve())).as_posix()


def spread(values: list[float], digits: int = 2) -> str:
    """The median, and the range in parentheses when there are several values (rounds)."""
    median = f"{statistics.median(values):.{digits}f}"
    return median if len(values) < 2 else f"{median} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def kept_notes(path: Path) -> str:
    """The notes block of the report at `path`, or a placeholder when there is none yet."""
    if path.exists():
        found = NOTES_RE.search(path.read_text())
        if found:
            return found.group(0)
    return NOTES_PLACEHOLDER
