"""The line of callers waiting for a spare: who is served, who is refused."""

import asyncio

import pytest

from runtime.spares import Spares


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
