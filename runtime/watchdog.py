"""WORKER_MEMORY_LIMIT_BYTES: a model's worker whose USS grows past it is killed, and the model heals.

Its calls get RESOURCE_EXHAUSTED (runtime/dispatch.py reads the kill cause). A pack holds
several models, each of which may take the limit: it is killed once it grows past what its
models are charged by more than the limit (a pack of a few models big enough would pass the
limit alone, and be killed and healed into another such pack until they were all dropped).
"""

from __future__ import annotations

import asyncio
import logging

from runtime import memory
from runtime.pool import WorkerPool
from runtime.worker import KillCause

log = logging.getLogger("mesh.watchdog")

CHECK_SECONDS = 0.5
MEMORY_LIMIT_REASON = "over WORKER_MEMORY_LIMIT_BYTES"


async def watch_memory(supervisor, pool: WorkerPool, limit: int) -> None:
    """Measures every serving model worker each CHECK_SECONDS; runs until cancelled."""
    while True:
        await asyncio.sleep(CHECK_SECONDS)
        # A pack serves several models: measured once. dict keeps the order and drops repeats.
        workers = list({w: None for model in supervisor.models() for w in model.replicas.workers if w.alive})
        try:
            sizes = await asyncio.to_thread(memory.uss_each, [w.pid for w in workers])
        except Exception:  # an unexpected error from /proc must not end the watch for good
            log.exception("the memory watchdog could not measure the workers; trying again")
            continue
        charged = dict(supervisor.packs.unclaimed())  # by a pack's pid: what its models are charged
        for worker, size in zip(workers, sizes, strict=True):
            allowed = limit + charged.get(worker.pid, 0)
            if size > allowed:
                beyond = (
                    f" (its models' {(allowed - limit) / 2**20:.0f} MiB and the limit)"
                    if allowed > limit
                    else ""
                )
                reason = f"{MEMORY_LIMIT_REASON}: {size / 2**20:.0f} MiB > {allowed / 2**20:.0f} MiB{beyond}"
                pool.kill(worker, KillCause.MEMORY, reason)
