"""Memory facts the runtime reports: a process's unique memory and the pod's capacity.

USS (unique set size) is what the OS gets back when that process dies, which is
exactly what unloading a model frees, so it is the size we report. We read it
from /proc/PID/smaps_rollup, which the kernel sums for us (what psutil's
memory_full_info().uss adds up from /proc/PID/smaps, at a fraction of the cost),
and fall back on psutil where smaps_rollup is missing.
"""
from __future__ import annotations

import os

import psutil

_PRIVATE_FIELDS = (b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:")

# cgroup v2, then v1: the container's memory limit when one is set.
_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _rollup(pid: int, fields: tuple[bytes, ...]) -> int | None:
    """The sum of `fields` in /proc/PID/smaps_rollup, in bytes; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            return 1024 * sum(int(line.split()[1]) for line in rollup if line.startswith(fields))
    except FileNotFoundError:
        if not psutil.pid_exists(pid):
            raise psutil.NoSuchProcess(pid) from None
    except PermissionError:
        pass
    return None


def uss(pid: int) -> int:
    """Unique memory of process `pid` in bytes; raises psutil.NoSuchProcess if it is gone."""
    value = _rollup(pid, _PRIVATE_FIELDS)
    return value if value is not None else psutil.Process(pid).memory_full_info().uss


def pss(pid: int) -> int:
    """Proportional memory of process `pid`: its unique pages plus its share of shared ones."""
    value = _rollup(pid, (b"Pss:",))
    return value if value is not None else psutil.Process(pid).memory_full_info().pss


def cgroup_limit() -> int | None:
    """The memory limit of our cgroup, or None when there is none."""
    for path in _CGROUP_LIMIT_FILES:
        try:
            with open(path) as limit_file:
                text = limit_file.read().strip()
        except OSError:
            continue
        if text == "max":
            return None
        limit = int(text)
        # cgroup v1 reports "no limit" as a huge page-aligned number.
        if limit >= psutil.virtual_memory().total:
            return None
        return limit
    return None


def container_memory(configured: int | None) -> int:
    """Memory the runtime may use: CONTAINER_MEM_REQ_BYTES, else the cgroup limit, else RAM."""
    if configured:
        return configured
    return cgroup_limit() or psutil.virtual_memory().total


def tree_pss(root_pid: int | None = None) -> int:
    """PSS summed over a process and all its descendants (default: this process).

    PSS, not USS: the fork server's preloaded frameworks are shared with every
    worker, so no process owns them uniquely, yet they occupy memory; summed
    PSS counts each such page exactly once.
    """
    root = psutil.Process(root_pid or os.getpid())
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += pss(process.pid)
        except psutil.Error:
            pass  # it ended while we counted
    return total
