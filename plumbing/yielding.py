"""Giving the CPU away, every fraction of a millisecond, during a stretch of work that must run at
normal priority.

Workers and the front's grpc threads run SCHED_BATCH (plumbing/priority.py):
a thread woken on a CPU where another one runs does not preempt it, but waits
until the running one's time slice ends, which the kernel checks at its tick
(every 4 ms at HZ=250). A pack loads python models on its main thread, which
serves calls afterwards and so cannot go to SCHED_IDLE the way a framework
load's thread does; a recycle's loads, one after another, would then keep a
survivor's call waiting up to a tick whenever one of the threads it passes
through is queued behind the load.

Inside `giving_way()`, a POSIX timer on the monotonic clock signals the main
thread every `every_s`, and the handler calls sched_yield(): a thread queued
on this CPU runs first, and where none is, the yield returns at once. The
work takes longer on a busy machine, by what the calls it lets through take.

The timer is a high-resolution one of its own (timer_create), not
setitimer's: CPU-time timers fire only at the tick, and SIGALRM belongs to
the user's code (a model may time its own calls with alarm()). Its signal is
a real-time one that nothing else here uses. System calls the work makes
restart after the handler where the kernel allows; the few it never restarts
(poll, select, sleeps) return EINTR, which Python's own calls retry.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
from collections.abc import Iterator

GIVE_WAY_EVERY_S = 0.0005
GIVE_WAY_SIGNAL = signal.SIGRTMAX - 1

_CLOCK_MONOTONIC = 1
_SIGEV_THREAD_ID = 4  # Linux: signal this one thread, not any thread of the process


class _Sigevent(ctypes.Structure):
    # glibc's struct sigevent on Linux: 64 bytes, the thread id first in the trailing union.
    _fields_ = [
        ("sigev_value", ctypes.c_void_p),
        ("sigev_signo", ctypes.c_int),
        ("sigev_notify", ctypes.c_int),
        ("sigev_notify_thread_id", ctypes.c_int),
        ("_pad", ctypes.c_int * 11),
    ]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_libc = ctypes.CDLL(None, use_errno=True)
log = logging.getLogger("mesh.worker")
_refusal_logged = False


def _give_way(signum, frame) -> None:
    os.sched_yield()


@contextlib.contextmanager
def giving_way(every_s: float = GIVE_WAY_EVERY_S) -> Iterator[None]:
    """Yields the CPU every `every_s` while the block runs; on the main thread only (Python runs
    signal handlers there), elsewhere, or where the kernel refuses the timer, the block just runs.
    GIVE_WAY_SIGNAL is the block's while it runs: whatever handled it before gets it back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_handler = signal.getsignal(GIVE_WAY_SIGNAL)
    timer = ctypes.c_void_p()
    armed = False
    try:
        signal.signal(GIVE_WAY_SIGNAL, _give_way)
        # The work's system calls restart after the handler rather than fail with EINTR.
        signal.siginterrupt(GIVE_WAY_SIGNAL, False)
        armed = _arm(timer, every_s)
        yield
    finally:
        try:
            if armed:
                _libc.timer_delete(timer)  # before the handler goes: a signal due arrives on its return
        finally:
            signal.signal(GIVE_WAY_SIGNAL, previous_handler)


def _arm(timer: ctypes.c_void_p, every_s: float) -> bool:
    """Creates and starts `timer`, signalling this thread every `every_s`; False if refused."""
    event = _Sigevent(
        sigev_signo=GIVE_WAY_SIGNAL,
        sigev_notify=_SIGEV_THREAD_ID,
        sigev_notify_thread_id=threading.get_native_id(),
    )
    if _libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(event), ctypes.byref(timer)) != 0:
        _refused("timer_create")
        return False
    period = _Timespec(int(every_s), int((every_s % 1) * 1e9))
    if _libc.timer_settime(timer, 0, ctypes.byref(_Itimerspec(period, period)), None) != 0:
        _refused("timer_settime")
        _libc.timer_delete(timer)
        return False
    return True


def _refused(call: str) -> None:
    """Logs the first refusal (a seccomp profile, say): every later block would be refused alike."""
    global _refusal_logged
    if not _refusal_logged:
        _refusal_logged = True
        error = os.strerror(ctypes.get_errno())
        log.warning("%s refused (%s): loads here do not give way to other threads", call, error)
