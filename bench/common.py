"""What every part of the benchmark shares: the repository's folder, progress lines, percentiles."""

from __future__ import annotations

import math
import os
import sys

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1024 * 1024
DAMON_ROOT = "/sys/kernel/mm/damon/admin/kdamonds"
# DAMON actions that take memory from processes without pressure: a cgroup's usage then falls
# over a long run while nothing in it changed.
RECLAIMING_ACTIONS = ("pageout", "lru_deprio")


def progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


def percentile(samples: list[float], p: float) -> float:
    """Nearest-rank percentile (with 50 samples p99 is the slowest one)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


def damon_reclaim(root: str = DAMON_ROOT) -> list[str]:
    """The kernel's running DAMON schemes that page memory out on their own ("kdamond 0: pageout")."""
    found = []
    for kdamond in _numbered(root):
        folder = os.path.join(root, kdamond)
        if _read(os.path.join(folder, "state")) != "on":
            continue
        contexts = os.path.join(folder, "contexts")
        for context in _numbered(contexts):
            schemes = os.path.join(contexts, context, "schemes")
            for scheme in _numbered(schemes):
                action = _read(os.path.join(schemes, scheme, "action"))
                if action in RECLAIMING_ACTIONS:
                    found.append(f"kdamond {kdamond}: {action}")
    return found


def _numbered(folder: str) -> list[str]:
    try:
        return sorted((name for name in os.listdir(folder) if name.isdigit()), key=int)
    except OSError:
        return []


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""
