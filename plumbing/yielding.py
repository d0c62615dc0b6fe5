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

Inside `giving_way()`, an interval timer interrupts the process every
`every_s`, and the handler calls sched_yield() on the main thread: a thread
queued on this CPU runs first, and where none is, the yield returns at once.
The work takes longer on a busy machine, by what the calls it lets through
take; on an idle one it costs a signal per interval.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

GIVE_WAY_EVERY_S = 0.0005
MIN_TIMER_S = 0.000001  # a timer due while the block ran fires at once after it


def _give_way(signum, frame) -> None:
    os.sched_yield()


@contextlib.contextmanager
def giving_way(every_s: float = GIVE_WAY_EVERY_S) -> Iterator[None]:
    """Yields the CPU every `every_s` while the block runs; on the main thread only (Python runs
    signal handlers there), elsewhere the block just runs. SIGALRM and the real-time interval
    timer are the block's: whatever held them before gets them back, its timer re-armed with
    what it had left less the block's time (a test runner's timeout, say)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_handler = signal.signal(signal.SIGALRM, _give_way)
    # The work's system calls restart after the handler rather than fail with EINTR.
    signal.siginterrupt(signal.SIGALRM, False)
    started = time.monotonic()
    previous_left, previous_interval = signal.setitimer(signal.ITIMER_REAL, every_s, every_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous_handler)
        if previous_left > 0:
            left = max(MIN_TIMER_S, previous_left - (time.monotonic() - started))
            signal.setitimer(signal.ITIMER_REAL, left, previous_interval)
