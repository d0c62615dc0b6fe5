"""The front gives its freed heap back to the OS once workers stop exiting and models stop loading
and unloading.

Each worker the pool reaps, and each model unloaded from a pack, frees what
the front held for it, and glibc keeps that memory mapped: after unloading a
thousand models the front stayed tens of MiB above where it started. A load
frees what it used on the way (replies, readings of the worker's memory). Some
of what those records hold is in reference cycles, freed only by a garbage
collection, which an idle front may not run for a long time; so the trim
collects first. Both hold the process for milliseconds (the collection holds
the GIL, malloc_trim() locks each arena), so they run in a thread, once per
burst: when QUIET_SECONDS have passed with no exit, load or unload, not after each.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Callable

from plumbing import heap

log = logging.getLogger("mesh.heap")

QUIET_SECONDS = 1.0


class QuietTrimmer:
    """Calls `trim` in a thread once `quiet_seconds` pass after the last note()."""

    def __init__(self, quiet_seconds: float = QUIET_SECONDS, trim: Callable[[], None] | None = None):
        self.quiet_seconds = quiet_seconds
        self._trim = trim or collect_and_trim
        self._last_note = 0.0
        self._task: asyncio.Task | None = None

    def note(self) -> None:
        """Something that held memory just went away: trim once things are quiet."""
        self._last_note = time.monotonic()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._trim_when_quiet(), name="heap-trim")

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _trim_when_quiet(self) -> None:
        while (wait := self._last_note + self.quiet_seconds - time.monotonic()) > 0:
            await asyncio.sleep(wait)
        try:
            await asyncio.to_thread(self._trim)
        except Exception:  # a failed trim costs memory, never a model: say so and go on
            log.exception("could not give the front's free heap back to the OS")


def freeze_what_start_up_made() -> int:
    """Keeps what the front built to start (modules, protobuf's descriptors, grpc's server) out of
    every later collection; how many objects that is. A full collection walked them all, holding
    the GIL, so the event loop, for milliseconds: the trim's collection after every recycle or
    burst of exits, and the interpreter's own from time to time. Collected first: garbage frozen
    would never be freed. Called before the pool starts, so no worker's records are frozen: they
    come and go, and some are freed only by a collection."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def collect_and_trim() -> None:
    """Frees what only a collection frees, then gives the free heap back."""
    gc.collect()
    heap.trim()
