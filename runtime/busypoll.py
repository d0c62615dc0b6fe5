"""The front's event loop polls, without sleeping, for a moment while workers owe it replies.

Why: on a virtual machine a CPU with nothing to run halts, and waking it to
deliver a worker's reply costs a few hundred microseconds, more than the
front's whole share of a small call. scripts/bench measured an echo call at
one client: p50 0.99 ms when the loop sleeps between the request and the
worker's reply, 0.62 ms when it polls through that gap. So, while replies
are awaited, select() polls the descriptors for up to BUSY_POLL_US before it
sleeps. A front with nothing in flight sleeps at once: an idle runtime costs
no CPU; so does a front whose workers have requests queued (they are
saturated, and need the CPU more than the front needs to hear them early:
runtime/channel.py replies_due_soon). Between polls it yields the CPU, so a
worker or a client that shares the core runs first.
"""
from __future__ import annotations

import asyncio
import os
import selectors
import time
from typing import Callable


_sleeping_select = selectors.DefaultSelector.select


class BusyPollSelector(selectors.DefaultSelector):
    """The event loop calls select() on every turn, so its common case stays one check long."""

    def __init__(self, poll_seconds: float):
        super().__init__()
        self.poll_seconds = poll_seconds
        self._awaiting: Callable[[], bool] = lambda: False

    def poll_while(self, awaiting: Callable[[], bool]) -> None:
        """Polls only while `awaiting()` is true (replies are due)."""
        self._awaiting = awaiting

    def select(self, timeout: float | None = None):
        # Timeout 0: the loop has callbacks to run and only collects what is ready.
        if timeout == 0 or self.poll_seconds <= 0 or not self._awaiting():
            return _sleeping_select(self, timeout)
        return self._poll_then_select(timeout)

    def _poll_then_select(self, timeout: float | None):
        started = time.perf_counter()
        give_up = started + (self.poll_seconds if timeout is None else min(self.poll_seconds, timeout))
        while True:
            events = _sleeping_select(self, 0)
            if events:
                return events
            if time.perf_counter() >= give_up or not self._awaiting():
                break
            os.sched_yield()
        # What is left of the caller's timeout, however long the polling took.
        left = None if timeout is None else max(0.0, timeout - (time.perf_counter() - started))
        return _sleeping_select(self, left)


def event_loop_factory(selector: BusyPollSelector) -> Callable[[], asyncio.AbstractEventLoop]:
    """For asyncio.Runner(loop_factory=...): a selector event loop over `selector`."""
    return lambda: asyncio.SelectorEventLoop(selector)
