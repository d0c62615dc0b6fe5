"""stacks PID|MODEL: the Python stack of every thread in that worker (or the model's workers).

The worker is not stopped: SIGUSR1 makes Python's faulthandler, registered in
every worker at start, write all thread stacks to RUNTIME_DIR/stacks/PID from
inside the signal handler, so it answers even while the model's code is busy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

from plumbing.stacks import stacks_path
from runtime.admin import AdminError, find_workers

WAIT_SECONDS = 2.0


async def run(supervisor, args: list[str]) -> dict:
    if len(args) != 1:
        raise AdminError("usage: stacks PID|MODEL")
    stacks = {}
    for worker in find_workers(supervisor, args[0]):
        path = stacks_path(supervisor.settings.runtime_dir, worker.pid)
        stacks[str(worker.pid)] = await _dump(worker, path)
    return stacks


async def _dump(worker, path: str) -> str:
    try:
        return await _signal_and_read(worker, path)
    except FileNotFoundError:
        # The pool deletes the file when it reaps the worker; a new worker
        # creates it as it sets up its handler.
        state = "has ended" if not worker.alive else "is still starting"
        raise AdminError(f"worker {worker.pid} {state}: it has no stacks file") from None


async def _signal_and_read(worker, path: str) -> str:
    # Emptied (the worker appends), never created: a file the pool deleted must
    # stay deleted, and SIGUSR1 kills a worker that has not set up its handler yet.
    # Never through a symlink either, as the worker opens it.
    fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)
    worker.signal(signal.SIGUSR1)
    deadline = time.monotonic() + WAIT_SECONDS
    size = -1
    while time.monotonic() < deadline:
        await asyncio.sleep(0.05)
        now = os.path.getsize(path)
        if now and now == size:  # written and no longer growing
            break
        size = now
    with open(path) as dump:
        text = dump.read()
    if not text:
        raise AdminError(f"worker {worker.pid} wrote no stacks within {WAIT_SECONDS} s")
    return text
