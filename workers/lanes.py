"""Call lanes: small messages between the front and a worker over a unix SOCK_SEQPACKET connection.

A message over the worker socket passes through two ZeroMQ I/O threads, the
sender's and the receiver's, each woken for it: at eight calls in flight
that cost a bare grpc.aio front with one ZeroMQ hop about a third of its CPU
per call (docs/benchmarks.md, "Call lanes"). A lane is a connected
SOCK_SEQPACKET socket between the front's event loop and the worker's main
thread: one system call sends a message, one receives it, and the kernel
keeps each message whole and in order.

Every worker connects to the front's lane socket as it starts and sends its
identity as the first packet. After that a call or a call's reply (header,
payload frames, as over ZeroMQ) whose frames fit LANE_MESSAGE_MAX and carry
no ring field goes over the lane; loads, drops and their replies, and any
message the lane cannot take at once (its socket buffer full, the lane
closed), over the worker socket. So the worker socket alone is always enough,
and a lane only saves work.

Order across the two: what was sent over the lane before a message over the
worker socket is handled before it. The worker takes as many lane messages
first as the socket message's `lane` field says the front had sent (calls
sent before a drop are answered before it runs; a big call is not overtaken
by the small ones sent after it, which follow it over the socket until it is
answered). The front drains the lane before a socket message (replies sent
before a drop's reply reach the front before it).

A packet: one byte, the number of frames n; n little-endian u32 sizes; the
frames back to back.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("mesh.lanes")

# A message bigger than this goes over the worker socket (big payload frames through the shared
# rings, workers/rings.py). A receiver reads into a buffer this big, so it is kept small.
LANE_MESSAGE_MAX = 32 * 1024
FRAMES_MAX = 255  # the count is one byte
RECEIVE_BYTES = 1 + 4 * FRAMES_MAX + LANE_MESSAGE_MAX
# How long a starting worker waits for the front to accept its connection.
CONNECT_SECONDS = 1.0
IDENTITY_MAX = 256

_SIZES = [struct.Struct(f"<B{n}I") for n in range(6)]  # the common counts, compiled once


def packet(frames: Sequence[Any]) -> list | None:
    """The buffers of one packet for sendmsg(), or None when the message is too big for a lane."""
    count = len(frames)
    if count > FRAMES_MAX:
        return None
    sizes, total = [], 0
    for frame in frames:  # a plain loop: cheaper than a comprehension and a sum
        size = len(frame) if type(frame) is bytes else memoryview(frame).nbytes
        sizes.append(size)
        total += size
    if total > LANE_MESSAGE_MAX:
        return None
    return [_sizes(count).pack(count, *sizes), *frames]


def _sizes(count: int) -> struct.Struct:
    return _SIZES[count] if count < len(_SIZES) else struct.Struct(f"<B{count}I")


class LaneError(ValueError):
    """A packet that is not one of ours."""


def frames_of(data: bytes) -> list[bytes]:
    """The frames of a packet, as bytes: a lane's messages are small, and slicing them costs less
    than views of the packet."""
    count = data[0] if data else 0
    start = 1 + 4 * count
    if count == 0 or len(data) < start:
        raise LaneError(f"a packet of {len(data)} bytes naming {count} frames")
    frames = []
    for size in _sizes(count).unpack_from(data)[1:]:
        end = start + size
        frames.append(data[start:end])
        start = end
    if start != len(data):
        raise LaneError(f"a packet of {len(data)} bytes whose frames add up to {start}")
    return frames


def send(sock: socket.socket, frames: Sequence[Any]) -> bool:
    """Sends one message; False when it did not go (too big, the buffer full, the lane closed)."""
    buffers = packet(frames)
    if buffers is None:
        return False
    try:
        sock.sendmsg(buffers)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError as error:  # the other end closed: its process is gone or going
        log.debug("a lane's send failed: %s", error)
        return False
    return True


def receive(sock: socket.socket) -> list[bytes] | None:
    """The packets waiting on the lane ([] if none); None once the other end has closed it."""
    packets: list[bytes] = []
    while got := receive_one(sock):
        packets += got
    return None if got is None and not packets else packets


def receive_one(sock: socket.socket) -> list[bytes] | None:
    """receive(), for one packet at most."""
    try:
        data = sock.recv(RECEIVE_BYTES)
    except (BlockingIOError, InterruptedError):
        return []
    except OSError as error:
        log.debug("a lane's receive failed: %s", error)
        return None
    return [data] if data else None


def connect(path: str, identity: bytes) -> socket.socket | None:
    """The worker's lane to the front at `path`, introduced by its identity; None if there is none
    (the front has no lane socket, or is too busy to accept): the worker socket does it all then."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(CONNECT_SECONDS)
        sock.connect(path)
        sock.sendall(identity)
        sock.setblocking(False)
    except OSError as error:
        log.info("no call lane to the front (%s): calls come over the worker socket", error)
        sock.close()
        return None
    return sock
