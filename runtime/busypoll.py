"""The front's event loop polls, without sleeping, for a moment while workers owe it replies.

Why: on a virtual machine a CPU with nothing to run halts, and waking it to
deliver a worker's reply costs a few hundred microseconds, more than the
front's whole share of a small call. scripts/bench measured an echo call at
one client: p50 0.99 ms when the loop sleeps between the request and the
worker's reply, 0.62 ms when it polls through that gap.

How: each request sent to a worker arms the poller for BUSY_POLL_US. While
it is armed and a reply is due, a callback keeps itself scheduled, so the
event loop (asyncio's or uvloop's alike) collects ready descriptors without
blocking instead of sleeping. A front with nothing in flight sleeps at once:
an idle runtime costs no CPU; so does a front whose workers have requests
queued (they are saturated, and need the CPU more than the front needs to
hear them early: runtime/channel.py replies_due_soon).

A turn yields the CPU only when the front may run on a single CPU. There the
worker that owes the reply can run nowhere else, and it is SCHED_BATCH, so it
would not preempt the polling loop. With more CPUs the kernel wakes the
worker on another one, and yielding would only hand the CPU of the thread
every call passes through to whoever else is runnable. On the 2-core bench
machine, dropping the yield served 9-16 % more echo calls a second at 16
clients and 2 % more at one (alternating bursts). With the whole runtime
pinned to one CPU, dropping it cost 12 % at one client.
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Callable


class BusyPoller:
    """Keeps one callback scheduled while a reply is due, for up to a window after each request."""

    def __init__(self, window_seconds: float, replies_due: Callable[[], bool],
                 yield_each_turn: bool | None = None):
        """yield_each_turn: by default, whether this process may run on one CPU only."""
        self.window_seconds = window_seconds
        self._replies_due = replies_due
        if yield_each_turn is None:
            yield_each_turn = len(os.sched_getaffinity(0)) == 1
        self.yield_each_turn = yield_each_turn
        self._until = 0.0
        self._spinning = False

    @property
    def spinning(self) -> bool:
        return self._spinning

    def arm(self) -> None:
        """A request just went out: poll for up to the window while its reply is due."""
        if self.window_seconds <= 0:
            return
        self._until = time.perf_counter() + self.window_seconds
        # Not due (a worker has a queue, as at 16 clients): no callback to schedule only to stop.
        if not self._spinning and self._replies_due():
            self._spinning = True
            asyncio.get_running_loop().call_soon(self._turn)

    def _turn(self) -> None:
        if self._replies_due() and time.perf_counter() < self._until:
            if self.yield_each_turn:
                os.sched_yield()
            asyncio.get_running_loop().call_soon(self._turn)
        else:
            self._spinning = False
