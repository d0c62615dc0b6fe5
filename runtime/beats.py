"""The beat file: how the front sees that a worker is alive without sending it a message.

A ping and its pong per worker and per second would wake the front and every
idle worker for each model loaded, so idle CPU would grow with the number of
models. Instead each worker stamps its own slot of a shared file with
time.monotonic() whenever its loop wakes, and an idle worker wakes only to do
that, as seldom as its silence limit allows (runtime/heartbeat.py idle_beat_ms). The front's
heartbeat reads the slots once a second (runtime/heartbeat.py): memory reads,
no system call, nothing sent.

The file is RUNTIME_DIR/beats, two float64 per slot (workers/protocol.py): the
last beat, and what a pack's main thread runs, which tells whose code killed
a pack that died (runtime/healing.py blamed()).
The pool hands each worker a slot in its spawn config and frees it once the
worker is reaped, so no two living processes ever share a slot. The file
only grows: a worker maps it whole when it starts, and a shrunk file would
kill a worker that touches its slot past the new end (SIGBUS). It grows
before the worker whose slot lies past its end is forked, so that worker's
mapping holds its slot.
"""

from __future__ import annotations

import contextlib
import heapq
import math
import mmap
import os
import time

from workers import protocol

BEATS_NAME = "beats"
_SLOTS_PER_PAGE = mmap.PAGESIZE // protocol.BEAT_BYTES


class BeatFile:
    """The front's side of the beat file: hands out slots, reads them, grows the file."""

    def __init__(self, runtime_dir: str):
        self.path = os.path.join(runtime_dir, BEATS_NAME)
        # A file an earlier front left is replaced, not reused: a process of that
        # front that still maps it must not stamp our slots. O_EXCL also refuses
        # to follow a symlink planted in its place.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._map: mmap.mmap | None = None
        self._fields: memoryview[float] = memoryview(b"").cast(protocol.BEAT_FORMAT)
        self._capacity = 0  # slots the file holds
        self._handed_out = 0  # slots ever handed out; the free ones are in _free
        self._free: list[int] = []  # a heap: the lowest slot is reused first, so the file stays small
        self._grow(_SLOTS_PER_PAGE)

    def allocate(self) -> int:
        """A slot for a worker about to be forked, stamped now: a new worker counts as heard from."""
        if self._free:
            slot = heapq.heappop(self._free)
        else:
            slot = self._handed_out
            self._handed_out += 1
            if slot >= self._capacity:
                self._grow(2 * self._capacity)
        self._fields[protocol.beat_index(slot)] = time.monotonic()
        self._fields[protocol.running_index(slot)] = protocol.NOTHING_RUNNING
        return slot

    def free(self, slot: int) -> None:
        """Gives back the slot of a worker that was reaped (or never forked)."""
        self._fields[protocol.beat_index(slot)] = math.inf  # never the oldest stamp
        heapq.heappush(self._free, slot)

    def last_beat(self, slot: int) -> float:
        """The time.monotonic() of the slot's last stamp."""
        return self._fields[protocol.beat_index(slot)]

    def running(self, slot: int) -> float:
        """The model_tag() of the model whose call or load the slot's pack runs, else NOTHING_RUNNING."""
        return self._fields[protocol.running_index(slot)]

    def oldest(self) -> float:
        """The oldest stamp of any slot in use, in one pass in C: inf when none is."""
        end = protocol.beat_index(self._handed_out)
        return min(self._fields[: end : protocol.FIELDS_PER_SLOT], default=math.inf)

    def close(self) -> None:
        self._unmap()
        os.close(self._fd)

    def _grow(self, slots: int) -> None:
        # Extending a small file and mapping it wait for no disk, and happen a
        # handful of times in a front's life: fine on the event loop. Its blocks
        # are reserved, not left a hole: a page of the map the file system cannot
        # back when it is first written (a full disk) would kill the front with
        # SIGBUS; refused here (OSError), it fails one worker's start.
        os.posix_fallocate(self._fd, 0, slots * protocol.BEAT_BYTES)
        self._unmap()
        self._map = mmap.mmap(self._fd, 0)
        self._fields = memoryview(self._map).cast(protocol.BEAT_FORMAT)
        self._capacity = slots

    def _unmap(self) -> None:
        self._fields.release()
        if self._map is not None:
            self._map.close()
            self._map = None
