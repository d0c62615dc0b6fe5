"""The line of callers waiting for a spare: who is served, who is refused."""

import asyncio
import collections
import os
import subprocess
import sys

import pytest

from runtime.spares import Spares
from runtime.worker import Worker


class Refused(Exception):
    pass


def test_callers_a_worker_on_its_way_will_serve_keep_their_place_and_the_rest_are_refused():
    async def scenario():
        spares = Spares(warm=1, groups=("base", "sklearn"))
        waits = [asyncio.ensure_future(spares.wait(group)) for group in ("base", "sklearn", "base", "base")]
        await asyncio.sleep(0)  # each is in line
        spares.fail_waiters("base", Refused(), served=1)
        await asyncio.sleep(0)
        first, other_group, second, third = waits
        assert not first.done() and not other_group.done()
        for refused in (second, third):
            with pytest.raises(Refused):
                refused.result()
        for waiting in (first, other_group):
            waiting.cancel()
        await asyncio.gather(first, other_group, return_exceptions=True)
        assert spares.waiting("base") == spares.waiting("sklearn") == 0

    asyncio.run(scenario())


def spare(pid: int) -> Worker:
    worker = Worker(f"w{pid}".encode(), process=None, group="base")
    worker.pid = pid  # notes its start time, as for a worker that said hello
    return worker


def test_a_spare_that_died_and_is_not_reaped_yet_is_not_handed_out():
    async def scenario():
        spares = Spares(warm=2, groups=("base",))
        process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        died, living = spare(process.pid), spare(os.getpid())
        spares.add(died)
        spares.add(living)
        process.kill()  # the OOM killer, say: its reap, through the fork server, comes later
        process.wait()
        return living, spares.pop("base"), spares.pop("base")

    living, first, second = asyncio.run(scenario())
    assert first is living and second is None


def test_a_fork_server_starting_a_worker_is_passed_over_and_no_spare_is_kept_warm_before_its_callers():
    async def scenario():
        spares = Spares(warm=1, groups=("base", "torch", "onnx"))
        waits = [asyncio.ensure_future(spares.wait(group)) for group in ("torch", "torch", "base")]
        await asyncio.sleep(0)
        busy = frozenset({"torch"})  # its start (one of two wanted) is under way
        starting = collections.Counter(torch=1)
        first = spares.group_short(starting, busy)  # the next caller's fork server
        waits[2].cancel()
        await asyncio.sleep(0)
        # Callers of the busy fork server still short: no spare kept warm takes their room.
        held = spares.group_short(starting, busy)
        for wait in waits[:2]:
            wait.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        return first, held, spares.group_short(collections.Counter(), frozenset({"base"}))

    first, held, warm = asyncio.run(scenario())
    assert (first, held, warm) == ("base", None, "torch")
