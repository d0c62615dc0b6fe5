"""What every part of the benchmark shares: the repository's folder, progress lines, percentiles."""

from __future__ import annotations

import math
import os
import sys

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1024 * 1024


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
