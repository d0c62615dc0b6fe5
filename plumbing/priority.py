"""Who dies first when memory runs out, and who runs first when the CPU is short.

The kernel's OOM killer should pick a worker (one model lost, and healed)
rather than the front (every model lost).

The front's event loop is one thread that every call of every model goes
through. By default Linux lets a thread that wakes up (a worker, or its
ZeroMQ I/O thread, when a message arrives) preempt the thread running on its
CPU, so on a busy machine each message could push the front off the CPU in
the middle of a turn. Workers ask for SCHED_BATCH, which drops that wake-up
preemption and nothing else: same nice level, same share of the CPU, and an
idle CPU still takes a waking worker at once. The front starts grpc's threads
the same way (runtime/server.py).

A pack loads framework models on a thread of SCHED_IDLE (workers/holding.py):
any other thread that wakes on that CPU preempts it at once, so a load does
not hold up other workers' calls, the first call of the model loaded just
before it among them. A thread may enter SCHED_IDLE without privilege but
may not leave it, so the loads get a thread of their own that stays there.

A pack the front kills once its models moved to a fresh one is made
SCHED_IDLE first: the kernel tears down a killed process's memory in that
process's own context, and that teardown should wait for the calls of the
pack that took its models over, not hold them up.
"""

import contextlib
import os

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


def schedule_this_thread_as_idle_work() -> bool:
    """SCHED_IDLE for the calling thread only, and for the threads it starts; False if refused.

    It runs only when no other thread wants its CPU (the kernel gives it a
    sliver, so it is slowed, never stopped). Leaving SCHED_IDLE needs
    CAP_SYS_NICE, so call it only on a thread that stays idle work.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return True
    except OSError:
        return False


def schedule_process_as_idle_work(pid: int) -> bool:
    """SCHED_IDLE for every thread of process `pid` (a policy is per thread); False if any refused
    or the process is gone. Meant for a process about to be killed: none of its threads may leave
    SCHED_IDLE without privilege.
    """
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    done = True
    for thread in threads:
        try:
            os.sched_setscheduler(int(thread), os.SCHED_IDLE, os.sched_param(0))
        except OSError:  # it exited meanwhile, or a seccomp profile forbids it
            done = False
    return done


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
