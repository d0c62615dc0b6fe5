"""Ties a process's life to its parent's, and names a process for good.

No orphans even when the front is SIGKILLed: each process asks Linux for a
signal when its parent dies. Linux delivers it when the parent *thread* that
forked us exits; the fork server forks from its only thread and the front
starts the fork server from its main thread, so "thread" means "process"
here.
"""

import contextlib
import ctypes
import os
import signal
import threading
import time

FORKSERVER_PID_ENV = "MESH_FORKSERVER_PID"
_PR_SET_PDEATHSIG = 1
_PF_EXITING = 0x4  # a task's flag in /proc/PID/stat


def die_with_parent(expected_parent: int | None) -> None:
    """SIGKILL this process when its parent dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died between fork and prctl: then we were re-parented.
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


# The pid of the process that last forked, as that process noted it just before: a child reads its
# own copy to tell whether its parent is the process it was forked from (see below).
_forked_by: int | None = None


def _note_forking_process() -> None:
    global _forked_by
    _forked_by = os.getpid()


def _die_with_the_forking_process() -> None:
    die_with_parent(_forked_by)


def children_die_with_this_process() -> None:
    """Every process forked from here on (by os.fork: multiprocessing's fork context, say), and
    those they fork in turn, gets SIGKILL when the one that forked it dies.

    A worker's model may start helper processes; without this, killing the
    worker for an unload left them running with their memory, and one that
    held a fork server's pipe kept the front from stopping. A child that
    execs (subprocess) forks in C and runs no hook: the front kills a
    worker's whole process group for those (runtime/worker.py), and a worker
    that exits by itself kills its children (kill_children()).
    """
    os.register_at_fork(before=_note_forking_process, after_in_child=_die_with_the_forking_process)


def kill_children() -> None:
    """SIGKILL to each child of this process (what its model started), as it exits by itself.

    Its children cannot be reaped, so their pids cannot be reused, until it
    exits: the pids read here name them. A child forked by os.fork would die
    with it anyway (above); one started by subprocess would not.
    """
    for child in children():
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def children(of_this_thread: bool = False) -> set[int]:
    """The pids of this process's children, zombies included: those any thread started, or those
    the calling thread did."""
    found: set[int] = set()
    threads = [threading.get_native_id()] if of_this_thread else os.listdir("/proc/self/task")
    for thread in threads:
        try:
            with open(f"/proc/self/task/{thread}/children") as listed:
                found.update(int(child) for child in listed.read().split())
        except OSError:
            continue  # the thread ended meanwhile
    return found


def end_children(identities: list[tuple[int, int]], wait_s: float = 1.0) -> None:
    """SIGKILLs each child named by process_identity() that still runs, and waits up to `wait_s`
    until they have exited (their memory back). Not reaped: the code that started them reaps
    them (multiprocessing and subprocess do, at their next start), and a reap of ours could
    leave that code waiting on a pid given since to another process."""
    ending = [identity for identity in identities if is_running(identity)]
    for pid, _ in ending:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(is_running(identity) for identity in ending) and time.monotonic() < deadline:
        time.sleep(0.001)


def forkserver_pid() -> int | None:
    """The fork server's pid as it recorded it before forking us (None outside a worker)."""
    value = os.environ.get(FORKSERVER_PID_ENV)
    return int(value) if value else None


def process_identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time in clock ticks): names one process for good, where a pid may be reused."""
    fields = _stat_fields(pid)
    return (pid, int(fields[19])) if fields else None


def is_running(identity: tuple[int, int] | list[int]) -> bool:
    """True while the process that `process_identity` named exists and is not a zombie."""
    pid, started = identity
    fields = _stat_fields(pid)
    return fields is not None and int(fields[19]) == started and fields[0] != "Z"


def is_exiting(identity: tuple[int, int]) -> bool:
    """Whether the process `process_identity` named has begun to exit, or is a zombie: the kernel
    flags it so before it tears its memory down, closes its files and signals its children's
    parent death."""
    pid, started = identity
    fields = _stat_fields(pid)
    return fields is not None and int(fields[19]) == started and bool(int(fields[6]) & _PF_EXITING)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            text = stat_file.read().decode(errors="replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()
