"""A record, in RUNTIME_DIR, of every process the front started, so that the
next front on the same RUNTIME_DIR can kill whatever an earlier one left.

Each process is a file `pids/<pid>` holding its start time: a pid alone could
by now belong to an unrelated process, a pid with the same start time cannot.
"""
from __future__ import annotations

import logging
import os
import signal
import time

import psutil

log = logging.getLogger("mesh.leftovers")

# Start times read twice from /proc can differ in the last digits.
_SAME_START_SECONDS = 0.05


class ProcessRegistry:
    def __init__(self, runtime_dir: str):
        self.folder = os.path.join(runtime_dir, "pids")
        os.makedirs(self.folder, mode=0o700, exist_ok=True)

    def add(self, pid: int) -> None:
        try:
            started = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            return
        with open(os.path.join(self.folder, str(pid)), "w") as record:
            record.write(repr(started))

    def remove(self, pid: int) -> None:
        try:
            os.unlink(os.path.join(self.folder, str(pid)))
        except FileNotFoundError:
            pass

    def purge(self, wait_seconds: float = 5.0) -> list[int]:
        """SIGKILLs every recorded process that still runs; returns their pids."""
        survivors = []
        for name in os.listdir(self.folder):
            process = self._recorded_process(name)
            if process is not None:
                survivors.append(process)
            os.unlink(os.path.join(self.folder, name))
        for process in survivors:
            log.warning("killing pid %d, left behind by an earlier runtime on this RUNTIME_DIR", process.pid)
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + wait_seconds
        while any(_running(p) for p in survivors) and time.monotonic() < deadline:
            time.sleep(0.02)
        stuck = [p.pid for p in survivors if _running(p)]
        if stuck:
            log.error("pids %s survived SIGKILL", stuck)
        return [p.pid for p in survivors]

    def _recorded_process(self, name: str) -> psutil.Process | None:
        try:
            with open(os.path.join(self.folder, name)) as record:
                started = float(record.read())
            process = psutil.Process(int(name))
            if abs(process.create_time() - started) > _SAME_START_SECONDS or process.pid == os.getpid():
                return None
            return process
        except (ValueError, OSError, psutil.Error):
            return None


def _running(process: psutil.Process) -> bool:
    """True while the process exists and is not a zombie (a zombie holds no memory)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
