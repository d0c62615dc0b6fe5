"""Ties a process's life to its parent's: no orphans even when the front is SIGKILLed.

Linux delivers the parent-death signal when the parent *thread* that forked us
exits; the fork server forks from its only thread and the front starts the
fork server from its main thread, so "thread" means "process" here.
"""
import ctypes
import os
import signal

FORKSERVER_PID_ENV = "MESH_FORKSERVER_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int | None) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died between fork and prctl: then we were re-parented.
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def forkserver_pid() -> int | None:
    """The fork server's pid as it recorded it before forking us (None outside a worker)."""
    value = os.environ.get(FORKSERVER_PID_ENV)
    return int(value) if value else None
