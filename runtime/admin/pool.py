"""pool: the worker pool and the memory budget.

Warm spares ready and wanted, worker processes and WORKERS_MAX, replicas and
threads per model, and capacity: as it would be reported to model-mesh now
(model-mesh keeps what it was told at READY), used by loaded models (their
reported sizes), and free; and what capacity holds back for packs not yet
full, whose base their models' sizes do not yet cover.
"""

from __future__ import annotations

import asyncio


async def run(supervisor, args: list[str]) -> dict:
    settings = supervisor.settings
    capacity = await asyncio.to_thread(supervisor.capacity)
    held_for_open_packs = await asyncio.to_thread(supervisor.open_packs_reserve)
    used = sum(m.size for m in supervisor.models())
    return {
        "spares": len(supervisor.pool.spares()),
        "workers_warm": settings.workers_warm,
        "workers": len(supervisor.pool.workers()),
        "workers_max": settings.workers_max,
        "model_replicas": settings.model_replicas,
        "worker_threads": settings.worker_threads,
        "models": len(supervisor.models()),
        "capacity_bytes": capacity,
        "used_bytes": used,
        "free_bytes": max(0, capacity - used),
        "held_for_open_packs_bytes": held_for_open_packs,
    }
