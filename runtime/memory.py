"""Memory facts the runtime reports: a process's unique memory and the pod's capacity.

USS (unique set size) is what the OS gets back when that process dies, which is
exactly what unloading a model frees, so it is the size we report. We read it
from /proc/PID/smaps_rollup, which the kernel sums for us (what psutil's
memory_full_info().uss adds up from /proc/PID/smaps, at a fraction of the cost),
and fall back on psutil on a kernel without smaps_rollup.

The processes we measure may exit while we read their /proc files, and the
kernel then answers ESRCH (exiting, or a zombie), ENOENT (reaped) or EACCES
(the pid now belongs to someone else). Every reader here turns those into one
contract: psutil.NoSuchProcess for a process that is gone, psutil.AccessDenied
for one that is not ours; callers catch psutil.Error.
"""

from __future__ import annotations

import os

import psutil

_PRIVATE_FIELDS = (b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:")

# cgroup v2, then v1: the container's memory limit when one is set.
_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


# smaps_rollup exists since Linux 4.14; only without it do we ask psutil.
_HAS_ROLLUP = os.path.exists("/proc/self/smaps_rollup")


def _rollup(pid: int, fields: tuple[bytes, ...]) -> int:
    """The sum of `fields` in /proc/PID/smaps_rollup, in bytes."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", "rb") as rollup:
            return 1024 * sum(int(line.split()[1]) for line in rollup if line.startswith(fields))
    except (ProcessLookupError, FileNotFoundError):
        raise psutil.NoSuchProcess(pid) from None
    except PermissionError:
        raise psutil.AccessDenied(pid) from None


def uss(pid: int) -> int:
    """Unique memory of process `pid` in bytes; raises psutil.Error if it is gone or not ours."""
    if _HAS_ROLLUP:
        return _rollup(pid, _PRIVATE_FIELDS)
    return psutil.Process(pid).memory_full_info().uss


def pss(pid: int) -> int:
    """Proportional memory of process `pid`: its unique pages plus its share of shared ones.

    Raises psutil.Error if it is gone or not ours.
    """
    if _HAS_ROLLUP:
        return _rollup(pid, (b"Pss:",))
    return psutil.Process(pid).memory_full_info().pss


def uss_or_zero(pid: int | None) -> int:
    """uss(), or 0 for a process that is gone, not ours or not started: none of our memory is in it."""
    if pid is None:
        return 0
    try:
        return uss(pid)
    except psutil.Error:
        return 0


def uss_each(pids: list[int | None]) -> list[int]:
    """uss_or_zero() of each pid; blocking, so run it in a thread."""
    return [uss_or_zero(pid) for pid in pids]


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

    A descendant that ends (or turns out not to be ours) while we count is
    skipped; raises psutil.Error only if the root itself is gone.
    """
    root = psutil.Process(root_pid or os.getpid())
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += pss(process.pid)
        except psutil.Error:
            if process is root:
                raise
    return total
