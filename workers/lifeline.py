"""Ties a process's life to its parent's; says who dies first when memory runs out,
and who runs first when the CPU is short.

No orphans even when the front is SIGKILLed: each process asks Linux for a
signal when its parent dies. And the kernel's OOM killer should pick a worker
(one model lost, and healed) rather than the front (every model lost).

The front's event loop is one thread that every call of every model goes
through. By default Linux lets a thread that wakes up (a worker, or its
ZeroMQ I/O thread, when a message arrives) preempt the thread running on its
CPU, so on a busy machine each message could push the front off the CPU in
the middle of a turn. Workers ask for SCHED_BATCH, which drops that wake-up
preemption and nothing else: same nice level, same share of the CPU, and an
idle CPU still takes a waking worker at once. The front starts grpc's threads
the same way (runtime/server.py).

Linux delivers the parent-death signal when the parent *thread* that forked us
exits; the fork server forks from its only thread and the front starts the
fork server from its main thread, so "thread" means "process" here.
"""
import contextlib
import ctypes
import logging
import os
import signal

from setproctitle import setproctitle

log = logging.getLogger("mesh.lifeline")

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


# Process titles name the RUNTIME_DIR so that a front can tell the processes an
# earlier front on the same folder left (its own to kill) from anything else.
# /proc/PID/environ cannot tell: setproctitle writes over it.
TITLE_PREFIX = "mesh-runtime "
RUNTIME_DIR_ENV = "MESH_RUNTIME_DIR"  # how the fork server learns it (set by the front)
_titled_dir = ""  # the RUNTIME_DIR this process last named in its title


def title(role: str, runtime_dir: str) -> str:
    """`mesh-runtime ROLE dir=RUNTIME_DIR`, e.g. `mesh-runtime worker model=m1 dir=/run/mesh`."""
    return f"{TITLE_PREFIX}{role} dir={runtime_dir}" if runtime_dir else f"{TITLE_PREFIX}{role}"


def set_title(role: str, runtime_dir: str | None = None) -> bool:
    """Titles this process (runtime_dir None: the one it named before); never raises, False if refused."""
    global _titled_dir
    if runtime_dir is not None:
        _titled_dir = runtime_dir
    try:
        setproctitle(title(role, _titled_dir))
        return True
    except (ValueError, OSError) as error:  # a NUL in a model id, say
        log.warning("cannot set the process title to %r: %s", role, error)
        return False


def is_runtime_process_of(cmdline: list[str], runtime_dir: str) -> bool:
    """True if a command line (psutil's split of it) is the title of a mesh-runtime process of runtime_dir.

    The directory ends the title, so a model id that holds " dir=..." cannot name another folder.
    """
    text = " ".join(part for part in cmdline if part)  # setproctitle pads with NULs: empty parts
    return bool(runtime_dir) and text.startswith(TITLE_PREFIX) and text.endswith(f" dir={runtime_dir}")


# /proc/PID/oom_score_adj runs from -1000 (never kill) to 1000 (kill first).
WORKER_OOM_SCORE_ADJ = 800
FRONT_OOM_SCORE_ADJ = -900


def set_oom_score_adj(value: int) -> bool:
    """Best effort: lowering the score needs CAP_SYS_RESOURCE, raising it does not."""
    try:
        with open("/proc/self/oom_score_adj", "w") as adj:
            adj.write(str(value))
        return True
    except OSError:
        return False


def schedule_as_batch_work() -> bool:
    """SCHED_BATCH for this process and the threads it starts from now on; False if refused.

    Needs no privilege (the static priority stays 0); a seccomp profile may still forbid it.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        return True
    except OSError:
        return False


@contextlib.contextmanager
def threads_started_here_run_as_batch_work():
    """Threads this thread starts inside the block run as SCHED_BATCH; this thread keeps its policy.

    Linux keeps a policy per thread and a new thread inherits its creator's, so
    this is how to reach threads a library starts without naming them.
    Yields False if the kernel refused.
    """
    policy, param = os.sched_getscheduler(0), os.sched_getparam(0)
    batch = schedule_as_batch_work()
    try:
        yield batch
    finally:
        if batch:
            os.sched_setscheduler(0, policy, param)


def stacks_path(runtime_dir: str, pid: int) -> str:
    """Where a worker's faulthandler writes its thread stacks on SIGUSR1."""
    return os.path.join(runtime_dir, "stacks", str(pid))


def dump_stacks_on_sigusr1(runtime_dir: str) -> None:
    """Lets the front read this process's Python stacks without stopping it."""
    import faulthandler
    path = stacks_path(runtime_dir, os.getpid())
    # Private, and never through a symlink: the stacks may show model data.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    stacks_file = open(fd, "a")  # kept open for the life of the process
    faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)


def process_identity(pid: int) -> tuple[int, int] | None:
    """(pid, start time in clock ticks): names one process for good, where a pid may be reused."""
    fields = _stat_fields(pid)
    return (pid, int(fields[19])) if fields else None


def is_running(identity: tuple[int, int] | list[int]) -> bool:
    """True while the process that `process_identity` named exists and is not a zombie."""
    pid, started = identity
    fields = _stat_fields(pid)
    return fields is not None and int(fields[19]) == started and fields[0] != "Z"


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name (which may hold spaces); None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat_file:
            text = stat_file.read().decode(errors="replace")
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()
