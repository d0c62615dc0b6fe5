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

A read holds its room until its request has come whole, so streams opened
and left silent would hold the room for as long as they stay open, and
every other call would wait behind them. A read under way for
SLOW_READ_SECONDS gives its room up as soon as a call waits for it: its
task is cancelled, and read_request() refuses that call.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time

from runtime import status

READ_LINE_MAX = 64
# A request of the largest size comes whole in milliseconds from model-mesh in the same pod; a
# read still under way after this long is a stalled or hostile client, or a very slow link.
SLOW_READ_SECONDS = 2.0

Read = int  # a read under way, as try_start_reading() and start_reading() name it


class ByteBudget:
    def __init__(self, per_model: int, total: int, largest_request: int):
        self.per_model = per_model
        self.total = total
        self.largest_request = largest_request
        self.held = 0
        self.reading = 0  # a largest_request for each read under way
        self._held_by_model: dict[str, int] = {}
        self._readers: collections.deque[tuple[asyncio.Future, asyncio.Task | None]] = collections.deque()
        # Reads under way, oldest first: when each began, and the task reading, to cancel it.
        self._reads: dict[Read, tuple[float, asyncio.Task | None]] = {}
        self._read_ids = itertools.count()
        self._gave_way: set[Read] = set()  # reads cancelled for a call waiting for their room
        self._slow_reads_timer: asyncio.TimerHandle | None = None

    def held_by(self, model_id: str) -> int:
        return self._held_by_model.get(model_id, 0)

    # -- reading ------------------------------------------------------------------

    def try_start_reading(self) -> Read | None:
        """Reserves room for the largest allowed request at once, if it fits and nobody waits; else None."""
        if self._readers or not self._room_to_read():
            return None
        return self._begin_read(asyncio.current_task())

    async def start_reading(self) -> Read:
        """Returns once a request of the largest allowed size fits.

        That much stays reserved until done_reading().
        """
        read = self.try_start_reading()
        if read is not None:
            return read
        if len(self._readers) >= READ_LINE_MAX:
            raise status.read_line_full(READ_LINE_MAX, self.total)
        turn = asyncio.get_running_loop().create_future()
        place = (turn, asyncio.current_task())
        self._readers.append(place)
        self._watch_slow_reads()
        try:
            return await turn  # _let_readers_in began our read
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.done_reading(turn.result())  # let in just as we gave up: pass it on
            elif place in self._readers:  # else a read that ended meanwhile already passed it by
                self._readers.remove(place)
            raise

    def done_reading(self, read: Read) -> None:
        del self._reads[read]
        if self._gave_way:
            self._gave_way.discard(read)
        self.reading -= self.largest_request
        self._let_readers_in()

    def gave_way(self, read: Read) -> bool:
        """Whether `read` was cancelled to give its room to a call waiting for it."""
        return read in self._gave_way

    def _begin_read(self, task: asyncio.Task | None) -> Read:
        read = next(self._read_ids)
        self._reads[read] = (time.monotonic(), task)
        self.reading += self.largest_request
        return read

    def _room_to_read(self) -> bool:
        return self.held + self.reading + self.largest_request <= self.total

    def _let_readers_in(self) -> None:
        while self._readers and self._room_to_read():
            turn, task = self._readers.popleft()
            if not turn.done():
                turn.set_result(self._begin_read(task))
        if self._readers and self._slow_reads_timer is None:
            self._watch_slow_reads()  # the reads just begun may stall too

    # -- reads that stall -----------------------------------------------------------

    def _watch_slow_reads(self) -> None:
        """While calls wait to be read, wakes when the oldest read under way turns slow."""
        if self._slow_reads_timer is not None or not self._readers:
            return
        oldest = next((began for read, (began, _) in self._reads.items() if read not in self._gave_way), None)
        if oldest is None:
            return  # the room is held by requests being served: it comes back as they end
        wait = max(0.001, oldest + SLOW_READ_SECONDS - time.monotonic())  # the loop's clock may run ahead
        self._slow_reads_timer = asyncio.get_running_loop().call_later(wait, self._cancel_slow_reads)

    def _cancel_slow_reads(self) -> None:
        """Cancels the slow reads, oldest first, one for each call waiting in line."""
        self._slow_reads_timer = None
        waiting = sum(not turn.done() for turn, _ in self._readers)
        now = time.monotonic()
        for read, (began, task) in list(self._reads.items()):
            if waiting == 0 or now - began < SLOW_READ_SECONDS:
                break  # the reads after this one began later
            if read in self._gave_way or task is None:
                continue
            self._gave_way.add(read)
            task.cancel()  # its done_reading() lets the first caller in line in
            waiting -= 1
        self._watch_slow_reads()

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
