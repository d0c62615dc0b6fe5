"""Bytes of requests the front holds: per model and in all, each with a ceiling.

MODEL_QUEUE_MAX bounds how many calls wait, not their size, and a request may
be as large as GRPC_MAX_MESSAGE_BYTES: without a byte budget a burst of big
calls to one slow model would grow the front without bound, until the OOM
killer takes the workers.

Two kinds of bytes count against FRONT_BYTES_MAX:
- held: a call's request, from the moment it is read until its answer is
  back (or its caller gave up). `reserve()` refuses, with RESOURCE_EXHAUSTED,
  a request that would pass MODEL_BYTES_MAX or FRONT_BYTES_MAX.
- being read: grpc buffers a request whole before handing it over, and its
  size is only known then, so a read counts as the largest request allowed
  while it lasts. `start_reading()` waits, in arrival order, until that much
  fits; a small request is read within a turn of the event loop, so the wait
  is short unless big requests really fill the budget. A stream waiting to
  be read holds up to HTTP/2's window of its request in the front (see
  runtime/server.py), so at most READ_LINE_MAX calls wait; the next one is
  refused at once.
"""

from __future__ import annotations

import asyncio
import collections

from runtime import status

READ_LINE_MAX = 64


class ByteBudget:
    def __init__(self, per_model: int, total: int, largest_request: int):
        self.per_model = per_model
        self.total = total
        self.largest_request = largest_request
        self.held = 0
        self.reading = 0  # a largest_request for each read under way
        self._held_by_model: dict[str, int] = {}
        self._readers: collections.deque[asyncio.Future] = collections.deque()

    def held_by(self, model_id: str) -> int:
        return self._held_by_model.get(model_id, 0)

    # -- reading ------------------------------------------------------------------

    def try_start_reading(self) -> bool:
        """Reserves room for the largest allowed request at once, if it fits and nobody waits; else False."""
        if self._readers or not self._room_to_read():
            return False
        self.reading += self.largest_request
        return True

    async def start_reading(self) -> None:
        """Returns once a request of the largest allowed size fits.

        That much stays reserved until done_reading().
        """
        if self.try_start_reading():
            return
        if len(self._readers) >= READ_LINE_MAX:
            raise status.read_line_full(READ_LINE_MAX, self.total)
        turn = asyncio.get_running_loop().create_future()
        self._readers.append(turn)
        try:
            await turn  # _let_readers_in reserved our share
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.done_reading()  # let in just as we gave up: pass it on
            elif turn in self._readers:  # else a read that ended meanwhile already passed it by
                self._readers.remove(turn)
            raise

    def done_reading(self) -> None:
        self.reading -= self.largest_request
        self._let_readers_in()

    def _room_to_read(self) -> bool:
        return self.held + self.reading + self.largest_request <= self.total

    def _let_readers_in(self) -> None:
        while self._readers and self._room_to_read():
            turn = self._readers.popleft()
            if not turn.done():
                self.reading += self.largest_request
                turn.set_result(None)

    # -- holding ------------------------------------------------------------------

    def reserve(self, model_id: str, size: int) -> None:
        """Counts a request's `size` against the model and the front, or raises RESOURCE_EXHAUSTED."""
        model_held = self._held_by_model.get(model_id, 0)
        if model_held + size > self.per_model:
            raise status.over_byte_budget(model_id, size, model_held, "MODEL_BYTES_MAX", self.per_model)
        if self.held + size > self.total:
            raise status.over_byte_budget(model_id, size, self.held, "FRONT_BYTES_MAX", self.total)
        self._held_by_model[model_id] = model_held + size
        self.held += size

    def release(self, model_id: str, size: int) -> None:
        self.held -= size
        left = self._held_by_model[model_id] - size
        if left:
            self._held_by_model[model_id] = left
        else:
            del self._held_by_model[model_id]
        self._let_readers_in()
