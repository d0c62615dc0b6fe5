"""The front's event loop can poll, without sleeping, for a moment while workers owe it replies.

Off by default (BUSY_POLL_US=0). Where waking an idle CPU is slow (some
virtual machines halt a CPU with nothing to run, and waking it to deliver a
worker's reply can cost more than the front's whole share of a small call),
polling through the gap between a request and its reply shortens a call at
one client. But the spin is CPU the call uses, and on the benchmark machine
it no longer bought any latency: docs/benchmarks.md has both measurements,
and scripts/bench shows which holds on a given machine. Under a CPU quota (a
pod's CPU limit) every thread of the pod draws from one budget per period,
so a spinning front takes CPU time from the very worker it waits for; the
start-up log says so when a window is set there.

How: each call sent to a worker arms the poller for BUSY_POLL_US (a load or a drop,
which takes milliseconds, does not: runtime/channel.py). While
it is armed and a reply is due, a callback keeps itself scheduled, so the
event loop (asyncio's or uvloop's alike) collects ready descriptors without
blocking instead of sleeping. A front with nothing in flight sleeps at once:
an idle runtime costs no CPU; so does a front whose workers have requests
queued (they are saturated, and need the CPU more than the front needs to
hear them early: runtime/channel.py replies_due_soon).

A turn yields the CPU only when the loop did nothing else since the turn
before: then the front is only waiting, and the worker that owes the reply
(SCHED_BATCH, so it does not preempt) may be queued on this very CPU. A loop
busy with other calls does not yield: that would hand the CPU of the one
thread every call passes through to whoever else is runnable (docs/benchmarks.md
has what yielding on every turn, and never yielding, cost).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable

from runtime import cgroups

CGROUP_ROOT = cgroups.CGROUP_ROOT

# A turn after which the loop's thread had used less CPU than this found the
# loop with nothing else to do. An idle turn takes 2-10 µs of CPU; a turn that
# waited behind other calls' callbacks mostly 25-200 µs (measured with one and
# with 16 clients).
IDLE_TURN_CPU_SECONDS = 25e-6


class BusyPoller:
    """Keeps one callback scheduled while a reply is due, for up to a window after each request."""

    def __init__(self, window_seconds: float, replies_due: Callable[[], bool]):
        self.window_seconds = window_seconds
        self._replies_due = replies_due
        self._until = 0.0
        self._spinning = False
        self._cpu_at_last_turn = 0.0

    @property
    def spinning(self) -> bool:
        return self._spinning

    def arm(self) -> None:
        """A request just went out: poll for up to the window while its reply is due."""
        if self.window_seconds <= 0:
            return
        self._until = time.perf_counter() + self.window_seconds
        # Not due (a worker has a queue, as at 16 clients): no callback to schedule only to stop.
        if not self._spinning and self._replies_due():
            self._spinning = True
            self._cpu_at_last_turn = time.thread_time()
            asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        if self._replies_due() and time.perf_counter() < self._until:
            self._yield_if_the_loop_was_idle()
            asyncio.get_running_loop().call_soon(self._turn)
        else:
            self._spinning = False

    def _yield_if_the_loop_was_idle(self) -> None:
        # The loop thread's own CPU time: other threads' and processes' load does not count.
        cpu = time.thread_time()
        if cpu - self._cpu_at_last_turn < IDLE_TURN_CPU_SECONDS:
            os.sched_yield()
        self._cpu_at_last_turn = cpu


def describe(window_us: int, cgroup_root: str = CGROUP_ROOT) -> str:
    """For the start-up log: the window, and whether a CPU quota makes it cost the workers' CPU."""
    if not window_us:
        return "off"
    chosen = f"up to {window_us} µs after each request"
    quota = cpu_quota_cores(cgroup_root)
    if quota is None:
        return chosen
    return (
        f"{chosen}, under a CPU quota of {quota:g} core{'' if quota == 1 else 's'}: "
        "the spin draws on the same quota as the workers (BUSY_POLL_US=0 leaves it to them)"
    )


def cpu_quota_cores(cgroup_root: str = CGROUP_ROOT, self_cgroup: str = cgroups.SELF_CGROUP) -> float | None:
    """The tightest CPU quota of this process's cgroup and those above it, in cores; None if none.

    cgroup v2: cpu.max ("max 100000" or "QUOTA PERIOD"); v1: cpu.cfs_quota_us (-1: none) over
    cpu.cfs_period_us, in the cpu controller's hierarchy.
    """
    quotas = []
    for member in cgroups.memberships("cpu", cgroup_root, self_cgroup):
        quotas += cgroups.read_up(member, _v2_quota if member.v2 else _v1_quota)
    return min(quotas, default=None)


def _v2_quota(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.max")) as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_quota(folder: str) -> float | None:
    try:
        with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
            quota = int(f.read())
        with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota < 0 or period <= 0 else quota / period
