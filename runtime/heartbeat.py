"""The front's heartbeat: every worker is pinged each second, and one that stays silent is hung.

Silence is judged only over time the front itself was running: after a stall
of the event loop (a hostile request, a paused container) every worker's
answers are still queued unread, so each is given a fresh silence limit
rather than killed for the front's own delay. A worker running a load or a
call (one thread) cannot answer either: LOADTIME_TIMEOUT and
WORKER_REQUEST_TIMEOUT_MS watch those.
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
_NOT_JUDGED = (WorkerState.STARTING, WorkerState.CONDEMNED, WorkerState.EXITED)


async def beat_forever(pool: WorkerPool, silence_limit: float) -> None:
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
            for worker in pool.workers():
                worker.last_seen = max(worker.last_seen, now)
        for worker in pool.workers():
            if worker.state in _NOT_JUDGED:
                continue
            silent = now - worker.last_seen
            if not worker.busy and silent > silence_limit:
                pool.kill(worker, KillCause.HUNG, f"hung: no heartbeat answer for {silent:.1f} s")
            else:
                pool.ping(worker)
