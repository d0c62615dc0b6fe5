"""Big payload frames between the front and a worker through shared memory, not the socket.

A frame of RING_MIN_BYTES or more sent over the worker socket is copied by
the sender's ZeroMQ I/O thread into the kernel and by the receiver's out of
it, a socket buffer at a time, with both threads woken for each: for big
frames that costs more than the rest of the call. Instead, each side copies
such a frame into a ring in a memfd both map, and the message carries an
empty frame in its place plus the header field `ring` saying where it is.
The receiver copies it out as soon as the message arrives, so each ring is
consumed in the order it was filled, and tells the sender how far it has
taken in the next message it sends anyway: ZeroMQ's message passing orders
the copies, no counter in the shared memory has to. Positions count bytes
since the ring was made, so they only grow; a frame never wraps (it starts
again at the ring's first byte).

The front makes a worker's rings the first time it sends the worker a big
frame: it offers the memfd (by its /proc path) in that call, which still
carries its frame over the socket; the worker maps it and says so in its
reply. A worker that cannot map it says why and is never offered again; a
frame that does not fit goes over the socket. So the socket alone is always
enough, and a ring only saves work.

The `ring` header field, in either direction, a map with any of:

    offer     [path, bytes per ring]   front -> worker: map this memfd
    accepted  true                     worker -> front: mapped
    refused   reason                   worker -> front: cannot map it
    frames    [[index, position, length], ...]
              the payload frames (index 0: the first after the header)
              that are in the sender's ring instead of the message
    taken     position                 the receiver has copied out all
                                       of the sender's ring up to here

The front's side is runtime/rings.py; this module is the ring and the
worker's side.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
from collections.abc import Sequence
from typing import Any

import msgpack

from workers import protocol

log = logging.getLogger("mesh.rings")

# Smaller frames cost less over the socket than the two copies a ring makes.
RING_MIN_BYTES = protocol.COPY_BELOW
FIELD = "ring"


class RingError(protocol.ProtocolError):
    """A ring field that does not describe frames in the ring."""


class Ring:
    """One direction of a memfd: the sender copies frames in, the receiver copies them out in order."""

    def __init__(self, view: memoryview):
        self.view = view
        self.size = len(view)
        self.head = 0  # sender: where the next frame may start
        self.tail = 0  # sender: how far the receiver last said it has taken
        self.taken = 0  # receiver: the end of the last frame copied out

    def put(self, data: memoryview) -> int | None:
        """Copies `data` (a flat view of bytes, byte_view()) in and returns its position; None while it
        does not fit."""
        size = len(data)
        first_byte = -(-self.head // self.size) * self.size  # the ring's first byte, this lap or the next
        # Free room ends where the oldest frame not taken yet starts, one lap on; an empty ring has it all.
        room_until = (first_byte if self.head == self.tail else self.tail) + self.size
        # The first byte whenever the frame fits there: frames keep to the ring's first pages, and
        # only as many of them are touched as the frames in flight need. Frames never wrap.
        if first_byte + size <= room_until:
            start = first_byte
        elif self.head % self.size + size <= self.size and self.head + size <= room_until:
            start = self.head
        else:
            return None
        offset = start % self.size
        self.view[offset : offset + size] = data
        self.head = start + size
        return start

    def take(self, position: Any, length: Any) -> bytes:
        """Copies out the frame the sender put at `position`."""
        if not (isinstance(position, int) and isinstance(length, int)) or length < 0:
            raise RingError(f"a ring frame at {position!r} of {length!r} bytes")
        offset = position % self.size
        if position < self.taken or offset + length > self.size:
            raise RingError(f"a ring frame at {position} of {length} bytes, after {self.taken} was taken")
        data = bytes(self.view[offset : offset + length])
        self.taken = position + length
        return data

    def told_taken(self, position: Any) -> None:
        """The receiver has taken everything before `position`: that room is free again."""
        if not isinstance(position, int) or not self.tail <= position <= self.head:
            raise RingError(f"taken {position!r}, with {self.tail} taken and {self.head} put")
        self.tail = position


# mmap(2), madvise(2) and munmap(2), as SharedMapping calls them.
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_MAP_FAILED = ctypes.c_void_p(-1).value


def _raise_errno() -> None:
    error = ctypes.get_errno()
    raise OSError(error, os.strerror(error))


class SharedMapping:
    """A shared mapping of a file, without the descriptor Python's mmap.mmap keeps open for its life:
    the front maps a memfd for each worker it sends big frames to, and its open files bound how
    many workers it may run (runtime/filelimit.py)."""

    def __init__(self, fd: int, length: int):
        address = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address == _MAP_FAILED:
            _raise_errno()
        self.address, self.length = address, length
        self.view = memoryview((ctypes.c_char * length).from_address(address)).cast("B")

    def free_pages(self) -> None:
        """Frees every page, for every process that maps the file (their next touch reads zeros)."""
        if _libc.madvise(self.address, self.length, mmap.MADV_REMOVE) != 0:
            _raise_errno()

    def close(self) -> None:
        """Unmaps it; every view of it must have been released."""
        self.view.release()
        _libc.munmap(self.address, self.length)


class RingPair:
    """The memfd of one worker: its first half carries frames to the worker, its second to the front."""

    def __init__(self, memory: SharedMapping, ring_bytes: int):
        self.memory = memory
        self.to_worker = Ring(memory.view[:ring_bytes])
        self.to_front = Ring(memory.view[ring_bytes:])

    @classmethod
    def create(cls, ring_bytes: int) -> tuple[RingPair, int]:
        """A new pair and its memfd, which the caller closes once the worker has mapped it."""
        fd = os.memfd_create("mesh-ring", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, 2 * ring_bytes)  # sparse: pages exist once a frame is written to them
            # Nobody may shrink it under the front's mapping: touching a page past the end is SIGBUS.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            return cls(SharedMapping(fd, 2 * ring_bytes), ring_bytes), fd
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def open(cls, path: str, ring_bytes: int) -> RingPair:
        """Maps the pair the front offered; raises OSError or RingError when it cannot."""
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        try:
            if os.fstat(fd).st_size != 2 * ring_bytes:
                raise RingError(f"{path} is not a pair of {ring_bytes}-byte rings")
            return cls(SharedMapping(fd, 2 * ring_bytes), ring_bytes)
        finally:
            os.close(fd)  # the mapping keeps the memfd

    def give_back(self) -> None:
        """Frees every page of both rings (for both processes); call only while neither holds a frame."""
        self.memory.free_pages()

    def close(self) -> None:
        self.to_worker.view.release()
        self.to_front.view.release()
        self.memory.close()


class WorkerRings:
    """The worker's side: maps the front's offer, takes frames out, puts big reply frames in."""

    def __init__(self) -> None:
        self.pair: RingPair | None = None
        self._to_say: dict[str, Any] = {}  # for the next message to the front
        self.in_use = False  # once offered: every message to the front goes through outgoing()

    def receive(self, field: Any, payloads: list) -> list:
        """The message's payloads with the frames in the ring copied out (field: its header's `ring`)."""
        field = checked(field)
        if "offer" in field:
            self.in_use = True
            self._map(field["offer"])
        pair = self.pair
        sending, receiving = (pair.to_front, pair.to_worker) if pair else (None, None)
        payloads = apply(field, sending, receiving, payloads)
        if pair is not None and field.get("frames"):
            self._to_say["taken"] = pair.to_worker.taken
        return payloads

    def _map(self, offer: Any) -> None:
        try:
            path, ring_bytes = offer
            if self.pair is not None:
                raise RingError("a second ring offered")
            self.pair = RingPair.open(path, ring_bytes)
        except (OSError, ValueError, TypeError) as error:  # RingError is a ValueError
            log.warning("payloads keep to the socket: cannot map the front's ring (%s)", error)
            self._to_say["refused"] = str(error)
        else:
            self._to_say["accepted"] = True

    def outgoing(self, frames: list) -> list:
        """`frames` ([header, *payloads]) with big payloads moved to the ring and the header saying so."""
        said, self._to_say = self._to_say, {}
        pair = self.pair
        if pair is not None:
            moved, in_ring = put_in(pair.to_front, frames, first=1)
            if in_ring:
                frames, said["frames"] = moved, in_ring
        if not said:
            return frames  # the very list: workers/loop.py sends it over the lane
        header = msgpack.unpackb(frames[0])
        header[FIELD] = said
        return [protocol.pack_fields(header), *frames[1:]]


def checked(field: Any) -> dict:
    """The header's ring field, which must be a map."""
    if not isinstance(field, dict):
        raise RingError(f"the ring field is {type(field).__name__}, not a map")
    return field


def apply(field: dict, sending: Ring | None, receiving: Ring | None, payloads: list) -> list:
    """What a peer's ring field says, applied: its `taken` frees room in the ring we send on, and
    its frames are copied out of the ring it sends on (None, None: no rings mapped)."""
    if sending is None or receiving is None:
        if "taken" in field or "frames" in field:
            raise RingError("ring frames, and no ring mapped")
        return payloads
    if "taken" in field:
        sending.told_taken(field["taken"])
    if field.get("frames"):
        payloads = taken_out(receiving, field["frames"], payloads)
    return payloads


def taken_out(ring: Ring, frames: Any, payloads: Sequence[Any]) -> list:
    """`payloads` with the empty frames that `frames` names replaced by their copies from `ring`."""
    payloads = list(payloads)
    # Every frame of one message is in the ring at once: together they fit in it. More would make
    # the receiver copy a ring's worth per frame named, for a message that costs nothing.
    room = ring.size
    try:
        for index, position, length in frames:
            if not isinstance(index, int) or index < 0 or payloads[index]:
                raise RingError(f"payload {index!r} cannot come from the ring")
            if not isinstance(length, int) or not 0 <= length <= room:
                raise RingError(f"a frame of {length!r} bytes, with {room} of the ring left for them")
            room -= length
            payloads[index] = ring.take(position, length)
    except (TypeError, ValueError, IndexError) as error:  # RingError is a ValueError
        raise RingError(f"ring frames {frames!r}: {error}") from None
    return payloads


def put_in(ring: Ring, frames: Sequence[Any], first: int = 0) -> tuple[list, list]:
    """Puts each frame of RING_MIN_BYTES or more from index `first` on into `ring` while they fit:
    (the frames with an empty one in place of each, [[payload index, position, length], ...])."""
    frames, in_ring = list(frames), []
    for index in range(first, len(frames)):
        data = byte_view(frames[index])
        if data is not None and len(data) >= RING_MIN_BYTES:
            position = ring.put(data)
            if position is not None:
                in_ring.append([index - first, position, len(data)])
                frames[index] = b""
    return frames, in_ring


def byte_view(frame: Any) -> memoryview | None:
    """The frame's bytes as one flat view; None for a buffer that is not one contiguous block."""
    try:
        return memoryview(frame).cast("B")
    except (TypeError, ValueError):
        return None
