"""A load that runs long in a pack: the pack's other models move out, and the pack is left to it.

A pack runs a load on its main thread (or waits on it while its idle loader
runs it: workers/holding.py), so while one model's constructor runs, the
pack's other models answer no call. A load of a model small enough for a
pack takes milliseconds; one that runs past SLOW_LOAD_SECONDS (a constructor
that sleeps, downloads, or never returns) would otherwise hold its
neighbours' calls for as long as it runs, up to LOADTIME_TIMEOUT.

So once a load has run that long beside models loaded in the pack (counted
from when the pack began it, not from when calls queued ahead were sent), those
models load into a fresh pack and their calls switch there while the load
runs on. Calls sent to the old pack before the switch are answered there
once the load is in. The old pack is then the slow model's alone: it takes
no other model and ends with it, and the model is charged all of the pack's
base, as a worker of its own would be. Once its load is in (or failed), the
pack drops its copies of the models that moved out, after the calls sent to
them there are answered, so that what it holds beyond its model is charged
to no one only while the load runs. A load of another model placed in the pack before the move stops
waiting for its lock then, and goes elsewhere. A model that cannot move, or
whose own load ran long (the others' calls would switch only once it loaded
again), stays, served and charged where it was, and the pack stays an
ordinary pack.
At the worker cap (the pool's at_cap()) no move is made: the models wait for
the load, and the last worker is kept for loads that need a pack.

A load given up on meanwhile (cancelled by its unload, or LOADTIME_TIMEOUT),
even as its reply comes, marks the pack abandoned, as any load given up on in
a pack does; the pack ends with its unload once it has answered the calls of
the models that moved out (runtime/packs.py Packs._end).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from runtime.model import Model
from runtime.pack import moves_with
from runtime.tasks import to_the_end
from runtime.worker import CALLS_CHECK_SECONDS, DRAIN_SECONDS, calls_answered

if TYPE_CHECKING:
    from runtime.pack import Pack
    from runtime.packs import Packs

log = logging.getLogger("mesh.packs")

# How long a load into a pack may hold the pack's other models before they move out: far longer
# than loading a model small enough for a pack takes (docs/density.md), far shorter than the
# deadlines of the calls it holds up.
SLOW_LOAD_SECONDS = 0.5
# How long the calls sent to the pack before a load may hold it with none of them answered before
# SLOW_LOAD_SECONDS count anyway: a call that never ends would hold it for ever.
AHEAD_WAIT_MAX_SECONDS = 2.0


async def send_load_beside_others(packs: Packs, pack: Pack, model: Model) -> dict:
    """Holding the pack's lock: has it load the model, its reply; if the load runs past
    SLOW_LOAD_SECONDS, the pack's other models move out meanwhile. Counted from when the pack begins
    the load: with one thread, once it has answered the calls sent to it before."""
    channel = packs.pool.channel
    ahead = channel.ahead_of_next(pack.worker.identity)
    load = asyncio.ensure_future(packs.send_load(pack, model))
    try:
        # Not for ever: a call ahead that never ends would keep the others waiting for the load.
        ahead_until = time.monotonic() + AHEAD_WAIT_MAX_SECONDS
        while ahead and not load.done() and time.monotonic() < ahead_until:
            await asyncio.sleep(CALLS_CHECK_SECONDS)
            if (left := channel.still_pending(ahead)) != ahead:  # one answered: the pack is not stuck
                ahead, ahead_until = left, time.monotonic() + AHEAD_WAIT_MAX_SECONDS
        await asyncio.wait([load], timeout=SLOW_LOAD_SECONDS)
        model.loads_slowly = not load.done()  # as its latest load went: a heal's may say otherwise
        if not load.done():
            await to_the_end(_leave_to(packs, pack, model))
        return await load
    except BaseException:
        # Given up on (cancelled), even as the reply came: the pack may hold the model, or still load it.
        pack.give_up_load(model.model_id)
        load.cancel()
        if load.done() and not load.cancelled():
            load.exception()  # seen: the caller's cancellation is what it raises
        raise


async def _leave_to(packs: Packs, pack: Pack, loading: Model) -> None:
    """Holding the pack's lock while `loading` loads there: the pack's other models move to a fresh
    pack, and it is left to `loading`. Where they cannot move, it stays as it was."""
    started = time.monotonic()
    # One whose own load ran long stays: the others' calls would switch only once it loaded again.
    movers = [
        m for m in pack.members.values() if m is not loading and moves_with(pack, m) and not m.loads_slowly
    ]
    if not movers or not pack.open:
        return
    if packs.pool.at_cap():  # the last worker it could have is better kept for loads that need one
        log.warning(
            "the load of %s in %r runs long; at the worker cap, its other models wait",
            loading.model_id,
            pack.worker,
        )
        return
    pack.open = False
    log.warning(
        "the load of %s in %r runs long: its %d other models move to a fresh pack",
        loading.model_id,
        pack.worker,
        len(movers),
    )
    moved = await packs.repacker.into_fresh_pack(pack, movers, "they wait for that load")
    # Those now in the fresh pack (their charges went with them): still held here until the load is in.
    pack.left_behind.update(m.model_id for m in movers if m.model_id not in pack.charged)
    # Those whose calls did not switch stay members: an unload of theirs waits for this pack's lock,
    # and one that could not move is served here still.
    pack.members = {i: m for i, m in pack.members.items() if m not in movers or pack.worker in m.workers}
    packs.pool.replenish()  # the spare it took: no reap of this pack refills it
    if moved and packs.on_recycle is not None:
        packs.on_recycle(time.monotonic() - started, len(moved))
    if pack.charged:  # some model stayed, or could not move: not left to the load alone, a pack as before
        pack.open = pack.worker.serving and not pack.abandoned
        return
    pack.left_to = loading
    pack.left.set()


@contextlib.asynccontextmanager
async def lock_unless_left(pack: Pack) -> AsyncIterator[bool]:
    """The pack's lock, held for the block (True); or, once the pack is left to a load that runs
    long, False and not held: a load placed in the pack before then goes elsewhere instead of
    waiting that load out."""
    if not pack.lock.locked():  # taken at once, as `async with pack.lock` would: no other load sees it free
        async with pack.lock:
            yield True
        return
    acquiring = asyncio.ensure_future(pack.lock.acquire())
    leaving = asyncio.ensure_future(pack.left.wait())
    held = False
    try:
        await asyncio.wait([acquiring, leaving], return_when=asyncio.FIRST_COMPLETED)
        held = acquiring.done()
    finally:
        leaving.cancel()
        if not acquiring.done():
            acquiring.cancel()  # an acquire cancelled before it is done never holds the lock
        elif not held:  # the wait was cancelled once the lock was ours
            pack.lock.release()
    try:
        yield held
    finally:
        if held:
            pack.lock.release()


async def drop_left_behind(packs: Packs, pack: Pack) -> None:
    """Holding the pack's lock once the load it was left to returned: it drops the models that
    moved out, each once the calls sent to it there are answered (or DRAIN_SECONDS passed, after
    which a recycled pack is killed under them too). Raises PeerGone if the pack dies."""
    worker = pack.worker
    deadline = time.monotonic() + DRAIN_SECONDS
    while pack.left_behind and worker.serving:
        model_id = pack.left_behind.pop()
        if not await calls_answered(worker, model_id, max(0.0, deadline - time.monotonic())):
            log.warning(
                "%r still runs calls of %s, which moved out: it drops it all the same", worker, model_id
            )
        await packs.pool.send_drop(worker, model_id)
