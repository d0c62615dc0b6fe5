"""The front's heartbeat: once a second it reads every worker's beat, and one that stays silent is hung.

A worker's beat is the later of its last message and its last stamp in the
beat file (runtime/beats.py), which its loop writes on every wake, idle or
not: nothing is sent to find out. A worker whose main thread is stuck (a
thread of its model holding the GIL, a stopped process) stamps nothing and
is killed once WORKER_HEARTBEAT_TIMEOUT_MS has passed.

Silence is judged only over time the front itself was running: after a
stall of the event loop (a hostile request, a paused container) the front
gives every worker a fresh silence limit rather than kill it for a pause
that may have stopped the workers too. A worker running a load or a call
(one thread) cannot beat either: LOADTIME_TIMEOUT and
WORKER_REQUEST_TIMEOUT_MS watch those.

The same tick has the pool look at its fork servers, so that one that died
with no worker of it left is reaped within a second, not at the next spawn.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from runtime.worker import KillCause, WorkerState

if TYPE_CHECKING:
    from runtime.pool import WorkerPool

log = logging.getLogger("mesh.heartbeat")

HEARTBEAT_SECONDS = 1.0
# The heartbeat waking this much later than due means the front's own loop was stalled.
STALL_SECONDS = 1.0
# Each beat of each idle worker is a wake-up that costs CPU, so an idle worker
# beats as seldom as leaves it this long to spare before its silence limit:
# a worker that is runnable but kept off the CPU that long by a busy machine
# must not be taken for hung. A short limit is beaten at least twice.
BEAT_MARGIN_MS = 2500
_NOT_JUDGED = (WorkerState.STARTING, WorkerState.CONDEMNED, WorkerState.EXITED)


def idle_beat_ms(silence_limit_ms: int) -> int:
    """How often an idle worker stamps its slot (workers/loop.py) under this silence limit."""
    return max(1, silence_limit_ms // 2, silence_limit_ms - BEAT_MARGIN_MS)


async def watch_forever(pool: WorkerPool, silence_limit: float) -> None:
    """Runs until cancelled; the pool kills the workers it finds hung."""
    due = time.monotonic() + HEARTBEAT_SECONDS
    while True:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        now = time.monotonic()
        late = now - due
        due = now + HEARTBEAT_SECONDS
        if late > STALL_SECONDS:
            log.warning(
                "the front's event loop stalled for %.1f s; no worker is judged on that silence", late
            )
            forgive(pool, now)
        judge(pool, now, silence_limit)
        pool.revive_forkservers()


def forgive(pool: WorkerPool, now: float) -> None:
    """Counts every worker as heard from now."""
    for worker in pool.workers():
        worker.last_seen = max(worker.last_seen, now)


def judge(pool: WorkerPool, now: float, silence_limit: float) -> None:
    """Kills every idle worker silent for longer than the limit."""
    if now - pool.beats.oldest() <= silence_limit:
        return  # every slot was stamped within the limit: no worker to look at one by one
    for worker in pool.workers():
        if worker.state in _NOT_JUDGED or worker.busy:
            continue
        silent = now - max(worker.last_seen, pool.last_beat(worker))
        if silent > silence_limit:
            pool.kill(worker, KillCause.HUNG, f"hung: no heartbeat for {silent:.1f} s")
