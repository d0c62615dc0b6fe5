"""Giving the CPU away during work that must run at normal priority (plumbing/yielding.py)."""

from __future__ import annotations

import os
import signal
import threading
import time

from plumbing import yielding


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_the_block_yields_the_cpu_again_and_again_and_then_leaves_no_trace(monkeypatch):
    yields: list[int] = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    handler_before = signal.getsignal(signal.SIGALRM)
    with yielding.giving_way(every_s=0.001):
        spin(0.05)  # CPU time: the real-time timer fires about fifty times
    assert len(yields) >= 2
    assert signal.getsignal(signal.SIGALRM) is handler_before
    assert signal.getitimer(signal.ITIMER_REAL)[1] == 0.0, "no repeating timer is left"


def test_a_timer_armed_before_the_block_is_armed_again_after_it():
    # pytest-timeout may hold SIGALRM too: its timer is put back the same way.
    fired: list[int] = []
    handler_before = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    timer_before = signal.getitimer(signal.ITIMER_REAL)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        with yielding.giving_way():
            spin(0.005)
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining < 30.0, "less the block's time"
        assert not fired, "the block's own signals go to its handler"
    finally:
        signal.signal(signal.SIGALRM, handler_before)
        signal.setitimer(signal.ITIMER_REAL, *timer_before)


def test_off_the_main_thread_the_block_runs_without_signals():
    seen: list[float] = []

    def work() -> None:
        with yielding.giving_way():
            seen.append(signal.getitimer(signal.ITIMER_REAL)[1])  # the repeat interval

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen == [0.0]
