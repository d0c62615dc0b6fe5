"""Bytes of requests the front holds: per model and in all, each with a ceiling.

MODEL_QUEUE_MAX bounds how many calls wait, not their size, and a request may
be as large as GRPC_MAX_MESSAGE_BYTES: without a byte budget a burst of big
calls to one slow model would grow the front without bound, until the OOM
killer takes the workers.

Two kinds of bytes count against FRONT_BYTES_MAX:
- held: a call's request, from the moment it is read until its answer is
  back (or its caller gave up). `reserve()` refuses, with RESOURCE_EXHAUSTED,
  a request that would pass MODEL_BYTES_MAX or FRONT_BYTES_MAX. A big
  response is held too, until its call ends (`hold_response()`): grpc keeps
  it until the client has read it, and can end a call only from its handler,
  which has returned by then. So a client that reads none of its responses
  keeps them as long as it likes, and responses may hold at most
  SENDING_SHARE of the budget: the rest stays for reading other calls.
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
SLOW_READ_SECONDS is ended as soon as a call waits for its room, and with
`read_limit` (the control methods' budget) any read under way that long is.
The budget does not cancel the reading task: it hands the read's owner (the
call, as runtime/reading.py's Caller) to `end_read`, which ends the call
from outside its handler (runtime/reading.py says why).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import time
from collections.abc import Callable
from typing import Any

from runtime import status

READ_LINE_MAX = 64
# The most of FRONT_BYTES_MAX that responses being sent may hold (see above).
SENDING_SHARE = 0.5
# A request of the largest size comes whole in milliseconds from model-mesh in the same pod; a
# read still under way after this long is a stalled or hostile client, or a slow link.
SLOW_READ_SECONDS = 5.0

Read = int  # a read under way, as try_start_reading() and start_reading() name it
# end_read(owner, still_reading, seconds, past_limit): end the call that owns a read under way for
# `seconds` (past read_limit, or slow while calls waited), if still_reading() says it has not ended.
ReadEnder = Callable[[Any, Callable[[], bool], float, bool], None]


class ByteBudget:
    def __init__(
        self,
        per_model: int,
        total: int,
        largest_request: int,
        end_read: ReadEnder | None = None,
        read_limit: float | None = None,
        name: str = "FRONT_BYTES_MAX",
    ):
        self.name = name  # as errors name it
        self.per_model = per_model
        self.total = total
        self.largest_request = largest_request
        self.end_read = end_read
        self.read_limit = read_limit  # seconds a read may last, whoever waits (None: no limit)
        self.held = 0
        self.sending = 0  # of `held`: responses until their calls end
        self.reading = 0  # a largest_request for each read under way
        self._held_by_model: dict[str, int] = {}
        self._readers: collections.deque[tuple[asyncio.Future, Any]] = collections.deque()
        # Reads under way, oldest first: when each began, and its owner, to end it.
        self._reads: dict[Read, tuple[float, Any]] = {}
        self._read_ids = itertools.count()
        self._ended: set[Read] = set()  # reads handed to end_read, until they are done
        self._slow_reads_timer: asyncio.TimerHandle | None = None
        self._slow_reads_due = 0.0  # when that timer fires (time.monotonic())

    def held_by(self, model_id: str) -> int:
        return self._held_by_model.get(model_id, 0)

    # -- reading ------------------------------------------------------------------

    def try_start_reading(self, owner: Any = None) -> Read | None:
        """Reserves room for the largest allowed request at once, if it fits and nobody waits; else None."""
        if self._readers or not self._room_to_read():
            return None
        return self._begin_read(owner)

    async def start_reading(self, owner: Any = None) -> Read:
        """Returns once a request of the largest allowed size fits.

        That much stays reserved until done_reading().
        """
        read = self.try_start_reading(owner)
        if read is not None:
            return read
        if len(self._readers) >= READ_LINE_MAX:
            raise status.read_line_full(READ_LINE_MAX, self.name, self.total)
        turn = asyncio.get_running_loop().create_future()
        place = (turn, owner)
        self._readers.append(place)
        self._watch_reads()
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
        if self._ended:
            self._ended.discard(read)
        self.reading -= self.largest_request
        if self._readers:  # nobody waits, nearly always: no call for every read
            self._let_readers_in()

    def _begin_read(self, owner: Any) -> Read:
        read = next(self._read_ids)
        self._reads[read] = (time.monotonic(), owner)
        self.reading += self.largest_request
        if self.read_limit is not None and self._slow_reads_timer is None:
            self._watch_reads()
        return read

    def _room_to_read(self) -> bool:
        return self.held + self.reading + self.largest_request <= self.total

    def _let_readers_in(self) -> None:
        while self._readers and self._room_to_read():
            turn, owner = self._readers.popleft()
            if not turn.done():
                turn.set_result(self._begin_read(owner))
        if self._readers and self._slow_reads_timer is None:
            self._watch_reads()  # the reads just begun may stall too

    # -- reads that stall -----------------------------------------------------------

    def _longest_wait(self) -> float | None:
        """How long the oldest read may last now: read_limit, or less while calls wait for room that
        no read already ended will give them; None: for ever."""
        waiting = sum(not turn.done() for turn, _ in self._readers) > len(self._ended)
        limits = [SLOW_READ_SECONDS] if waiting else []
        if self.read_limit is not None:
            limits.append(self.read_limit)
        return min(limits, default=None)

    def _watch_reads(self) -> None:
        """Wakes when the oldest read under way has lasted as long as it may."""
        longest = self._longest_wait()
        if longest is None or self.end_read is None:
            return
        oldest = next((began for read, (began, _) in self._reads.items() if read not in self._ended), None)
        if oldest is None:
            return  # the room is held by requests being served: it comes back as they end
        due = oldest + longest
        if self._slow_reads_timer is not None:
            if self._slow_reads_due <= due:
                return
            self._slow_reads_timer.cancel()  # set for read_limit; a call in line now wants it sooner
        self._slow_reads_due = due
        wait = max(0.001, due - time.monotonic())  # the loop's clock may run ahead
        self._slow_reads_timer = asyncio.get_running_loop().call_later(wait, self._end_slow_reads)

    def _end_slow_reads(self) -> None:
        """Ends, oldest first, the reads past read_limit, and slow reads until the calls in line
        have room (each read ended gives its room back once its handler has let go of it)."""
        self._slow_reads_timer = None
        assert self.end_read is not None  # _watch_reads() sets no timer without it
        waiting = sum(not turn.done() for turn, _ in self._readers) - len(self._ended)
        now = time.monotonic()
        for read, (began, owner) in list(self._reads.items()):
            lasted = now - began
            over_limit = self.read_limit is not None and lasted >= self.read_limit
            if not over_limit and not (waiting > 0 and lasted >= SLOW_READ_SECONDS):
                break  # the reads after this one began later
            if read in self._ended:
                continue
            self._ended.add(read)
            waiting -= 1
            seconds = self.read_limit if over_limit and self.read_limit is not None else SLOW_READ_SECONDS
            self.end_read(owner, functools.partial(self._reads.__contains__, read), seconds, over_limit)
        self._watch_reads()

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
        if self._readers:  # as in done_reading()
            self._let_readers_in()

    def hold_response(self, model_id: str, size: int) -> None:
        """Counts a response being sent as reserve() does, or raises RESOURCE_EXHAUSTED when
        responses would hold more than SENDING_SHARE of the front's budget (or than the largest
        request, where that is more: the largest answer fits on its own), or leave no room to read
        the largest request: a client that reads no answer must not stop every call's read."""
        limit = min(
            max(int(self.total * SENDING_SHARE), self.largest_request), self.total - self.largest_request
        )
        if self.sending + size > limit:
            raise status.responses_over_budget(model_id, size, self.sending, limit)
        self.reserve(model_id, size)
        self.sending += size

    def release_response(self, model_id: str, size: int) -> None:
        self.sending -= size
        self.release(model_id, size)
