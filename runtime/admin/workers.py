"""workers: one row per worker process.

Each row: pid, role (spare, model, or pack: a worker holding several small
models, each listed under `models` with the bytes it is charged and whether its
load ran long, as the `models` command says), model id, state (starting, spare,
loading, serving, condemned, exited: runtime/worker.py), uptime in seconds, USS and RSS in bytes, CPU % since
the last `workers` call, calls in flight, calls served, calls failed, the
last error, the big payload frames that crossed its shared-memory rings
([to it, from it], null before it has rings: runtime/rings.py), and the
messages that crossed its call lane ([to it, from it], null without a lane:
runtime/lanes.py).
"""

from __future__ import annotations

import asyncio
import time

import psutil

from runtime import memory

_processes: dict[int, psutil.Process] = {}  # kept between calls so cpu_percent has a baseline


def _measure(pids: list[int]) -> dict[int, tuple[int, int, float]]:
    """(USS, RSS, CPU %) of each pid; zeros for one that ended (or is not ours) while we looked."""
    figures = {}
    for pid in pids:
        try:
            figures[pid] = _figures(pid)
        except psutil.Error:
            _processes.pop(pid, None)
            figures[pid] = (0, 0, 0.0)
    for gone in set(_processes) - set(pids):
        del _processes[gone]
    return figures


def _figures(pid: int) -> tuple[int, int, float]:
    process = _processes.get(pid)
    if process is None:
        process = _processes[pid] = psutil.Process(pid)
    return memory.uss(pid), process.memory_info().rss, process.cpu_percent(None)


def _member(pack, model_id: str, size: int) -> dict:
    model = pack.members.get(model_id)
    return {"model": model_id, "bytes": size, "loads_slowly": model is not None and model.loads_slowly}


async def run(supervisor, args: list[str]) -> list[dict]:
    workers = [w for w in supervisor.pool.workers() if w.pid is not None]
    figures = await asyncio.to_thread(_measure, [w.pid for w in workers])
    now = time.monotonic()
    lanes = supervisor.pool.channel.lanes
    rows = []
    for worker in sorted(workers, key=lambda w: w.pid):
        uss, rss, cpu = figures[worker.pid]
        pack = supervisor.packs.of(worker)
        members = sorted(pack.charged.items()) if pack is not None else []
        rows.append(
            {
                "pid": worker.pid,
                "role": "pack" if worker.packed else "model" if worker.model_id else "spare",
                "model": f"{len(members)} models" if worker.packed else worker.model_id or "",
                "models": [_member(pack, model_id, size) for model_id, size in members],
                "state": worker.state.value,
                "uptime_s": round(now - worker.started, 1),
                "uss_bytes": uss,
                "rss_bytes": rss,
                "cpu_percent": cpu,
                "in_flight": worker.in_flight,
                "served": worker.served,
                "errors": worker.errors,
                "last_error": worker.last_error or worker.kill_reason,
                "ring_frames": supervisor.pool.channel.rings.frames(worker.identity),
                "lane_messages": lanes.messages(worker.identity) if lanes is not None else None,
            }
        )
    return rows
