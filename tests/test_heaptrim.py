"""plumbing/heap.py and runtime/heaptrim.py: freed heap goes back to the OS, once per burst of exits."""

from __future__ import annotations

import asyncio
import gc
import logging
import re
import subprocess
import sys
import time
import weakref

from harness import Runtime

from runtime.heaptrim import QuietTrimmer, collect_and_trim

QUIET = 0.2


def test_trim_gives_a_fragmented_heap_back_to_the_os():
    # Every 50th buffer kept alive pins the heap's top, so glibc's automatic
    # trim at free() cannot shrink it; only malloc_trim() returns the holes.
    script = """
import os
from plumbing import heap

def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

buffers = [bytearray(4000) for _ in range(50_000)]
kept = buffers[::50]
del buffers
before = resident()
heap.trim()
print(before - resident())
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    given_back = int(run.stdout)
    assert given_back > 100 * 1024 * 1024


class Record:
    """Stands for a reaped worker's records: they refer to each other, so only a collection frees them."""

    def __init__(self):
        self.me = self
        self.buffer = bytearray(1024 * 1024)


def test_the_front_collects_cycles_before_it_trims():
    gc.disable()  # no automatic collection may free it first
    try:
        record = Record()
        alive = weakref.ref(record)
        del record
        assert alive() is not None
        collect_and_trim()
        assert alive() is None
    finally:
        gc.enable()


def test_a_burst_of_notes_trims_once_when_it_is_quiet():
    trims: list[float] = []

    async def burst() -> float:
        trimmer = QuietTrimmer(QUIET, lambda: trims.append(time.monotonic()))
        for _ in range(5):
            trimmer.note()
            last_note = time.monotonic()
            await asyncio.sleep(QUIET / 4)
        assert trims == []  # not while notes keep coming
        await asyncio.sleep(QUIET * 3)
        return last_note

    last_note = asyncio.run(burst())
    assert len(trims) == 1
    assert trims[0] - last_note >= QUIET * 0.9


def test_a_failed_trim_is_logged_and_the_next_burst_trims_again(caplog):
    calls: list[int] = []

    def failing_once() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise OSError("no")

    async def two_bursts() -> None:
        trimmer = QuietTrimmer(QUIET / 4, failing_once)
        trimmer.note()
        await asyncio.sleep(QUIET)
        trimmer.note()
        await asyncio.sleep(QUIET)

    with caplog.at_level(logging.ERROR, logger="mesh.heap"):
        asyncio.run(two_bursts())
    assert len(calls) == 2
    assert "could not give the front's free heap back" in caplog.text


def test_cancel_stops_a_pending_trim():
    trims: list[int] = []

    async def cancelled() -> None:
        trimmer = QuietTrimmer(QUIET, lambda: trims.append(1))
        trimmer.note()
        trimmer.cancel()
        await asyncio.sleep(QUIET * 2)

    asyncio.run(cancelled())
    assert trims == []


def test_freezing_the_start_up_collects_its_garbage_first():
    script = """
import gc, weakref
from runtime.heaptrim import freeze_what_start_up_made

class Cycle:
    def __init__(self):
        self.me = self

gc.disable()
garbage = Cycle()
dead = weakref.ref(garbage)
del garbage
kept = [Cycle() for _ in range(1000)]
frozen = freeze_what_start_up_made()
print(dead() is None, frozen >= 1000, gc.get_freeze_count() == frozen, gc.collect(2) == 0)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["True", "True", "True", "True"]


def test_the_front_leaves_its_start_up_objects_out_of_collections():
    # Its trim's collections, after each recycle or burst of exits, then walk only what came after.
    with Runtime() as rt:
        found = re.search(r"(\d+) objects of the start-up left out of garbage collections", rt.log())
        assert found is not None, rt.log()
        assert int(found.group(1)) > 10_000  # modules, descriptors, grpc's server
