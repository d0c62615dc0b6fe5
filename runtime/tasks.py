"""Work the front must not leave half done when the task that began it is cancelled.

A move of packed models (runtime/repacking.py) cut short would leave a fresh
pack half made beside an old one that was closed but never killed; so it runs
in a task of its own, and the caller that is cancelled waits for it before it
sees its cancellation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

log = logging.getLogger("mesh.packs")

T = TypeVar("T")


async def to_the_end(work: Awaitable[T]) -> T:
    """`work`'s result, awaited in a task of its own that cancelling the caller does not stop: the
    caller waits for it all the same, and is cancelled once it is done (an error of the work's
    after that is logged, not raised: the caller's cancellation is what it must see)."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if task.cancelled():  # the work itself was cancelled: the loop is closing
            raise
        while not task.done():
            try:
                await asyncio.wait([task])
            except asyncio.CancelledError:  # cancelled again meanwhile: still waits
                pass
        if not task.cancelled() and task.exception() is not None:
            log.error("work whose caller was cancelled failed", exc_info=task.exception())
        raise
