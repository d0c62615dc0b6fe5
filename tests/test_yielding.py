"""Giving the CPU away during work that must run at normal priority (plumbing/yielding.py)."""

from __future__ import annotations

import os
import signal
import threading
import time
import types

from plumbing import yielding


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_the_block_yields_the_cpu_again_and_again_and_stops_with_it(monkeypatch):
    yields: list[int] = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    handler_before = signal.getsignal(yielding.GIVE_WAY_SIGNAL)
    with yielding.giving_way(every_s=0.001):
        spin(0.05)  # fifty periods of the timer
    assert len(yields) >= 2
    assert signal.getsignal(yielding.GIVE_WAY_SIGNAL) is handler_before
    after_the_block = len(yields)
    spin(0.02)
    assert len(yields) == after_the_block, "the timer went with the block"


def test_sigalrm_stays_the_codes_own_inside_the_block_and_after_it():
    # A model may time its calls with alarm(), and install that handler while it loads.
    fired: list[int] = []
    handler_before = signal.getsignal(signal.SIGALRM)
    timer_before = signal.getitimer(signal.ITIMER_REAL)  # pytest-timeout may hold it
    try:
        with yielding.giving_way(every_s=0.001):
            signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
            spin(0.02)
            assert signal.getitimer(signal.ITIMER_REAL)[1] == timer_before[1], "setitimer's is untouched"
        assert not fired, "the block's signals are not SIGALRM"
        assert signal.getsignal(signal.SIGALRM) is not handler_before, "the code's handler is kept"
    finally:
        signal.signal(signal.SIGALRM, handler_before)


def test_off_the_main_thread_the_block_runs_without_signals():
    seen: list[object] = []

    def work() -> None:
        with yielding.giving_way():
            seen.append(signal.getsignal(yielding.GIVE_WAY_SIGNAL))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    assert seen and seen[0] is not yielding._give_way


def test_a_refused_timer_leaves_the_block_running_and_is_logged_once(monkeypatch, caplog):
    monkeypatch.setattr(yielding, "_refusal_logged", False)
    monkeypatch.setattr(yielding, "_libc", types.SimpleNamespace(timer_create=lambda *_: -1))
    ran = []
    for _ in range(2):
        with yielding.giving_way():
            ran.append(signal.getsignal(yielding.GIVE_WAY_SIGNAL) is yielding._give_way)
    assert len(ran) == 2, "the work runs all the same"
    refusals = [r.message for r in caplog.records if "refused" in r.message]
    assert len(refusals) == 1 and "timer_create refused" in refusals[0]
