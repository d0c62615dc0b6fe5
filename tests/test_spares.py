"""The line of callers waiting for a spare: who is served, who is refused."""

import asyncio
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
