"""Whether the kernel's OOM killer ran: what tells a worker killed for memory from one killed by hand.

A worker the OOM killer ends exits as any SIGKILLed process does, and the log
and the status said only "killed by SIGKILL", leaving the operator to guess.
The kernel counts its OOM kills: per memory cgroup (v2 `memory.events`, v1
`memory.oom_control`, both `oom_kill`) and for the whole machine
(`/proc/vmstat`). The pool reads the count at every worker's exit; a worker
that died of a SIGKILL the front did not send while the count rose is
reported as out of memory, one such worker per kill counted. Most likely so,
not surely: another process's OOM kill in the same cgroup at the same time
would look the same.
"""

from __future__ import annotations

import os
import time

from runtime import cgroups

CGROUP_ROOT = cgroups.CGROUP_ROOT
MACHINE_COUNT = "/proc/vmstat"
_KEY = "oom_kill"
# How long a kill counted waits to be claimed: the reap of the worker it ended comes at once, unless
# the pool's reaping thread is busy (stopping or starting a fork server).
CLAIM_SECONDS = 10.0


class OomKills:
    """The OOM kill count of the cgroup this process is in (else of the machine), as last read, and
    the kills counted lately that no worker's death was put down to yet."""

    def __init__(self, self_cgroup: str = cgroups.SELF_CGROUP, cgroup_root: str = CGROUP_ROOT):
        self.path = counter_path(self_cgroup, cgroup_root)
        self._seen = read_count(self.path)
        self._unclaimed: list[float] = []  # when each was counted (time.monotonic())

    def claim(self, candidate: bool) -> bool:
        """Reads the count (blocking: a file read) at a worker's reap; whether the death of this
        `candidate` (a SIGKILL the front did not send) is put down to a kill not yet claimed. Each
        kill is claimed once, and only by a candidate: two workers killed together are both told,
        and a worker the front killed, reaped between, takes none."""
        now = time.monotonic()
        count = read_count(self.path)
        if count is not None and self._seen is not None and count > self._seen:
            self._unclaimed += [now] * (count - self._seen)
        self._seen = count
        self._unclaimed = [counted for counted in self._unclaimed if now - counted < CLAIM_SECONDS]
        if not candidate or not self._unclaimed:
            return False
        self._unclaimed.pop(0)
        return True


def counter_path(self_cgroup: str = cgroups.SELF_CGROUP, cgroup_root: str = CGROUP_ROOT) -> str:
    """The file holding the OOM kill count of this process's memory cgroup, else the machine's."""
    for member in cgroups.memberships("memory", cgroup_root, self_cgroup):
        # v2's counts the kills in the cgroups below too; v1's those of its own processes.
        candidate = os.path.join(member.folder, "memory.events" if member.v2 else "memory.oom_control")
        if read_count(candidate) is not None:
            return candidate
    return MACHINE_COUNT


def read_count(path: str) -> int | None:
    """The `oom_kill` line's number in `path`; None where the file or the line is not there."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == _KEY:
                    return int(value)
    except (OSError, ValueError):
        pass
    return None
