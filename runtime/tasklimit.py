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

from runtime import cgroups

CGROUP_ROOT = cgroups.CGROUP_ROOT

# A worker's own tasks: its main thread, and ZeroMQ's I/O and reaper threads.
TASKS_PER_WORKER = 3
# Kept free whatever the workers: the front's threads come and go (grpc's, the
# executors', a timer per fork), and a model's threads start at any time.
RESERVED_TASKS = 16


def room_for_a_worker(
    cgroup_root: str = CGROUP_ROOT, self_cgroup: str = cgroups.SELF_CGROUP, *, starting: int = 0
) -> bool:
    """True unless a pids cgroup of this process, or one above it, is within a worker and the
    reserve of its pids.max; also within the tasks of `starting` workers on their way, which may
    not have started them yet."""
    left = tasks_left(cgroup_root, self_cgroup)
    return left is None or left >= TASKS_PER_WORKER * (starting + 1) + RESERVED_TASKS


def shortage(cgroup_root: str = CGROUP_ROOT, self_cgroup: str = cgroups.SELF_CGROUP) -> str | None:
    """Why no worker may start, told for an operator, when a pids limit leaves too few tasks; else None.
    Where the runtime's own start failed, this names the cause that a thread or a fork refused by the
    kernel only hints at."""
    left = tasks_left(cgroup_root, self_cgroup)
    if left is None or left >= TASKS_PER_WORKER + RESERVED_TASKS:
        return None
    return (
        f"{max(left, 0)} tasks left under the pids cgroup's pids.max, fewer than the "
        f"{TASKS_PER_WORKER + RESERVED_TASKS} a worker needs beside the front's: "
        "raise the container's pids limit"
    )


def tasks_left(cgroup_root: str = CGROUP_ROOT, self_cgroup: str = cgroups.SELF_CGROUP) -> int | None:
    """The fewest tasks any pids cgroup of this process, or one above it, may still start; None
    where none has a limit (or none can be read). A folder that is not there (a container that
    sees only its own cgroup) is passed over."""
    left: list[int] = []
    for member in cgroups.memberships("pids", cgroup_root, self_cgroup):
        left += cgroups.read_up(member, _left_in)
    return min(left, default=None)


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
