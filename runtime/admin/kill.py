"""kill PID|MODEL: SIGKILL that worker (or all of the model's workers).

A model worker is replaced as after any crash: its calls fail UNAVAILABLE,
the model reloads in a fresh worker (or is dropped after MODEL_CRASH_LIMIT
crashes). A killed spare is replaced by the pool.
"""

from __future__ import annotations

from runtime.admin import AdminError, find_workers
from runtime.worker import KillCause


async def run(supervisor, args: list[str]) -> list[int]:
    if len(args) != 1:
        raise AdminError("usage: kill PID|MODEL")
    workers = find_workers(supervisor, args[0])
    for worker in workers:
        supervisor.pool.kill(worker, KillCause.OPERATOR, "killed by an operator (kill command)")
    return [w.pid for w in workers]
