"""Whether the worker's front still runs: a pidfd where the kernel gives one, else /proc now and then.

The front sends nothing to an idle worker, so silence proves nothing. A
pidfd of the front turns readable once it exits, and the worker polls it
beside its socket: watching costs no wake. Where the kernel or seccomp
refuses pidfd_open, the worker reads /proc every `check_seconds` instead;
the parent-death signal (plumbing/lifeline.py) covers the rest.
"""

from __future__ import annotations

import os

from plumbing import lifeline


class FrontWatch:
    def __init__(self, front: tuple[int, int] | None, check_seconds: float):
        """front: (pid, start time) of the front, None for a worker run without one (taken as gone)."""
        self.front = front
        self.check_seconds = check_seconds
        self.check_at = 0.0  # without a pidfd: when to look in /proc next
        self.pidfd = self._open_pidfd()

    def _open_pidfd(self) -> int | None:
        if self.front is None:
            return None
        try:
            pidfd = os.pidfd_open(self.front[0])
        except OSError:
            return None
        if not self.running():  # the pid names another process now
            os.close(pidfd)
            return None
        return pidfd

    def start(self, now: float) -> None:
        self.check_at = now + self.check_seconds

    def gone(self, ready: list, now: float) -> bool:
        """The pidfd is among the `ready` ones, or, without one, /proc says so at a due check."""
        if self.pidfd is not None:
            return self.pidfd in ready
        if now < self.check_at:
            return False
        self.check_at = now + self.check_seconds
        return not self.running()

    def running(self) -> bool:
        return self.front is not None and lifeline.is_running(self.front)
