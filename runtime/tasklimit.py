"""The pids cgroup's task limit, checked before each worker is forked.

A container's pids cgroup caps its tasks (processes and threads). At the
limit a fork fails (EAGAIN), or a worker's threads cannot start and it
aborts: the load waiting for it would wait for a worker that never comes,
and multiprocessing's fork server, left to itself, exits on a failed fork
with every worker it forked (workers/preload.py keeps it serving). So the
pool forks no worker that would leave the cgroup (or one above it that it
can see) fewer than RESERVED_TASKS to spare: the load that needed it is
refused at once, naming pids.max, as at the open-file limit
(runtime/filelimit.py). A limit on a cgroup the container cannot see (a
pod's) is met by the fork server's survival alone.
"""

from __future__ import annotations

import os

CGROUP_ROOT = "/sys/fs/cgroup"

# A worker's own tasks: its main thread, and ZeroMQ's I/O and reaper threads.
TASKS_PER_WORKER = 3
# Kept free whatever the workers: the front's threads come and go (grpc's, the
# executors', a timer per fork), and a model's threads start at any time.
RESERVED_TASKS = 16


def room_for_a_worker(cgroup_root: str = CGROUP_ROOT, self_cgroup: str = "/proc/self/cgroup") -> bool:
    """True unless a pids cgroup of this process, or one above it, is within a worker and the
    reserve of its pids.max."""
    left = tasks_left(cgroup_root, self_cgroup)
    return left is None or left >= TASKS_PER_WORKER + RESERVED_TASKS


def tasks_left(cgroup_root: str = CGROUP_ROOT, self_cgroup: str = "/proc/self/cgroup") -> int | None:
    """The fewest tasks any pids cgroup of this process, or one above it, may still start; None
    where none has a limit (or none can be read)."""
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    left: list[int] = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            top = cgroup_root
        elif "pids" in controllers.split(","):
            top = os.path.join(cgroup_root, controllers)
            if not os.path.isdir(top):
                top = os.path.join(cgroup_root, "pids")
        else:
            continue
        left += _left_up(os.path.join(top, path.lstrip("/")), top)
    return min(left, default=None)


def _left_up(folder: str, top: str) -> list[int]:
    """pids.max - pids.current in `folder` and each folder above it up to `top`, where limited.
    A folder that is not there (a container that sees only its own cgroup) is passed over."""
    found = []
    while True:
        left = _left_in(folder)
        if left is not None:
            found.append(left)
        if os.path.normpath(folder) == os.path.normpath(top) or len(folder) <= len(top):
            return found
        folder = os.path.dirname(folder)


def _left_in(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, "pids.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(folder, "pids.current")) as f:
            return int(limit) - int(f.read())
    except (OSError, ValueError):
        return None
