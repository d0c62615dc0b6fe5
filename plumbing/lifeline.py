"""Ties a process's life to its parent's, and names a process for good.

No orphans even when the front is SIGKILLed: each process asks Linux for a
signal when its parent dies, and a fork server, told so, ends every process
below it first. Linux delivers it when the parent *thread* that forked us
exits; the fork server forks from its only thread, and the front starts the
fork servers from the pool's spawner thread, which lives as long as the pool.
"""

import contextlib
import ctypes
import os
import signal
import threading
import time

# A process named for good: (pid, start time in clock ticks), as process_identity() gives.
Identity = tuple[int, int]

FORKSERVER_PID_ENV = "MESH_FORKSERVER_PID"
_PR_SET_PDEATHSIG = 1
_PF_EXITING = 0x4  # a task's flag in /proc/PID/stat


def die_with_parent(expected_parent: int | None, signum: int = signal.SIGKILL) -> None:
    """`signum` (SIGKILL) to this process when its parent dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    # The parent may have died between fork and prctl: then we were re-parented.
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


# The pid of the process that last forked, as that process noted it just before: a child reads its
# own copy to tell whether its parent is the process it was forked from (see below).
_forked_by: int | None = None
_forked_by_main_thread = True


def _note_forking_process() -> None:
    global _forked_by, _forked_by_main_thread
    _forked_by = os.getpid()
    _forked_by_main_thread = threading.current_thread() is threading.main_thread()


def _die_with_the_forking_process() -> None:
    # Linux sends the signal when the *thread* that forked ends: a helper a model starts from a
    # thread of its own would die with that thread. Those are left to the group kill below.
    if _forked_by_main_thread:
        die_with_parent(_forked_by)


def children_die_with_this_process() -> None:
    """Every process forked from here on by the main thread (by os.fork: multiprocessing's fork
    context, say), and those they fork in turn, gets SIGKILL when the one that forked it dies.

    A worker's model may start helper processes; without this, killing the
    worker for an unload left them running with their memory, and one that
    held a fork server's pipe kept the front from stopping. A child that
    execs (subprocess) forks in C and runs no hook, and one forked by another
    thread would die with that thread: the front kills a worker's whole
    process group for those (runtime/worker.py), and a worker that exits by
    itself kills its children (kill_children()).
    """
    os.register_at_fork(before=_note_forking_process, after_in_child=_die_with_the_forking_process)


def end_everything_below_with_parent() -> None:
    """For a fork server: SIGTERM when its parent (the front) dies, however it dies, on which it
    SIGKILLs every process below it, then exits.

    The workers below die with it anyway (their parent-death signal), but what
    a worker's model started with subprocess has no such signal (it forks in
    C, past the hooks above), and one that left the worker's process group
    (setsid) no group kill reaches: with the front gone, nobody else would end
    them. So the whole tree is read first (each process's children, while
    their parents still live to list them), then all of it is killed, then
    each worker's process group (what its model started that the tree no
    longer shows). A process forked from here resets the handler: a worker
    sets its own, and until then takes SIGTERM as any process does.
    """
    here = os.getpid()

    def end_all_and_exit(signum, frame) -> None:
        # Once: a second SIGTERM (the parent-death signal may come more than once) would start
        # it over on a tree this run has half killed, and exit before this run is done.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        kill_descendants(here)
        for child in children():  # each worker leads a group of its own (workers/main.py)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child, signal.SIGKILL)
        os._exit(0)

    signal.signal(signal.SIGTERM, end_all_and_exit)
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    die_with_parent(expected_parent=None, signum=signal.SIGTERM)


def kill_descendants(pid: int) -> None:
    """SIGKILL to every process below `pid`, those that left its process group included: the tree
    is read whole first, while each parent lives to list its children."""
    for below in descendants(pid):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(below, signal.SIGKILL)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` that /proc shows as a child of a child (and so on), parents first."""
    found: list[int] = []
    parents = [pid]
    while parents:
        parent = parents.pop()
        for child in children_of(parent):
            found.append(child)
            parents.append(child)
    return found


def kill_children() -> None:
    """SIGKILL to every process below this one (what its model started, and what that started in
    turn), as it exits by itself.

    Its children cannot be reaped, so their pids cannot be reused, until it
    exits: the pids read here name them. A child forked by os.fork would die
    with it anyway (above); one started by subprocess would not, nor one that
    left its process group (setsid) below a child of it.
    """
    kill_descendants(os.getpid())


def children(of_this_thread: bool = False) -> set[int]:
    """The pids of this process's children, zombies included: those any thread started, or those
    the calling thread did."""
    return children_of(os.getpid(), threading.get_native_id() if of_this_thread else None)


def children_of(pid: int, thread: int | None = None) -> set[int]:
    """The pids of a process's children (or of those one of its threads started); none once it is gone."""
    found: set[int] = set()
    try:
        threads = [thread] if thread is not None else os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for each in threads:
        try:
            with open(f"/proc/{pid}/task/{each}/children") as listed:
                found.update(int(child) for child in listed.read().split())
        except OSError:
            continue  # the thread ended meanwhile
    return found


def end_children(identities: list[Identity], wait_s: float = 1.0) -> None:
    """SIGKILLs each child named by process_identity() that still runs, and every process below
    it, and waits up to `wait_s` until the children have exited (their memory back). Not reaped:
    the code that started them reaps them (multiprocessing and subprocess do, at their next
    start), and a reap of ours could leave that code waiting on a pid given since to another
    process."""
    ending = [identity for identity in identities if is_running(identity)]
    for pid, _ in ending:
        kill_descendants(pid)  # read while it lives to list them
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(is_running(identity) for identity in ending) and time.monotonic() < deadline:
        time.sleep(0.001)


def forkserver_pid() -> int | None:
    """The fork server's pid as it recorded it before forking us (None outside a worker)."""
    value = os.environ.get(FORKSERVER_PID_ENV)
    return int(value) if value else None


def process_identity(pid: int) -> Identity | None:
    """(pid, start time in clock ticks): names one process for good, where a pid may be reused."""
    fields = _stat_fields(pid)
    return (pid, int(fields[19])) if fields else None


def is_running(identity: Identity | list[int]) -> bool:
    """True while the process that `process_identity` named exists and is not a zombie."""
    pid, started = identity
    fields = _stat_fields(pid)
    return fields is not None and int(fields[19]) == started and fields[0] != "Z"


def lives(identity: Identity) -> bool:
    """is_running() and not is_exiting(): a process killed a moment ago is neither, from one read."""
    pid, started = identity
    fields = _stat_fields(pid)
    return (
        fields is not None
        and int(fields[19]) == started
        and fields[0] != "Z"
        and not int(fields[6]) & _PF_EXITING
    )


def is_exiting(identity: Identity) -> bool:
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
