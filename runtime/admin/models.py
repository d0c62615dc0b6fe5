"""models: one entry per model in the table.

Each entry: model id, state (loading, ready, unloading), format, path, ready
replicas and replicas wanted, worker pids, size in bytes as last measured,
calls waiting in its line, crashes within MODEL_CRASH_WINDOW_MS, whether it is
healing, `degraded` (ready but short of replicas), and `loads_slowly` (a load of it
into a pack ran past 0.5 s: it is not loaded again beside serving models where
that can be helped, runtime/slowloads.py).
"""

from __future__ import annotations


async def run(supervisor, args: list[str]) -> list[dict]:
    wanted = supervisor.settings.model_replicas
    entries = []
    for model in supervisor.models():
        ready = len(model.replicas.workers)
        healing = model.heal_task is not None and not model.heal_task.done()
        entries.append(
            {
                "model": model.model_id,
                "state": model.state.value,
                "format": model.spec.format.name,
                "path": model.spec.path,
                "replicas_ready": ready,
                "replicas_wanted": wanted,
                "pids": [w.pid for w in model.workers],
                "size_bytes": model.size,
                "waiting": model.replicas.waiting,
                "recent_crashes": len(model.crashes),
                "healing": healing,
                "degraded": model.state.value == "ready" and (ready < wanted or healing),
                "loads_slowly": model.loads_slowly,
            }
        )
    return entries
