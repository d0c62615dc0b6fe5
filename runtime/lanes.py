"""The front's side of the call lanes: a listening SOCK_SEQPACKET socket, one connection per worker.

workers/lanes.py says why and how. Each worker connects as it starts and
names itself in its first packet; from then on its connection is read by the
event loop like the worker socket, and the channel sends it the calls that
fit. The kernel tells who connected (SO_PEERCRED): a connection whose process
is not the worker it names, once the pool knows that worker's pid, is closed.
A worker's lane goes when it does (`forget()`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Callable, Sequence
from typing import Any

from workers import lanes

log = logging.getLogger("mesh.lanes")

# Connections the kernel queues until the event loop accepts them: every spare connects as it starts.
BACKLOG = 512
# How long the front stops accepting lanes after it could not (out of descriptors): the connection
# waits in the backlog meanwhile, and its worker sends over it, so it is accepted once it can be;
# watched, the listening socket would wake the loop on every turn till then.
ACCEPT_PAUSE_SECONDS = 0.5
_PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid

# on_message(worker identity, [header frame, *payload frames])
OnMessage = Callable[[bytes, list], None]


class FrontLanes:
    def __init__(self, path: str, on_message: OnMessage, pid_of: Callable[[bytes], int | None]):
        """path: where to listen; pid_of(identity): the pid of the worker of that identity, None
        while the pool does not know it."""
        self.path = path
        self._on_message = on_message
        self._pid_of = pid_of
        self._listening: socket.socket | None = None
        self._lanes: dict[bytes, socket.socket] = {}
        self._counts: dict[bytes, list[int]] = {}  # messages over each lane: [to the worker, from it]
        self._unnamed: set[socket.socket] = set()  # accepted, their first packet not read yet
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        """Listens (the worker socket alone serves where it cannot)."""
        self._loop = asyncio.get_running_loop()
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # left by a front that was killed: RUNTIME_DIR is ours alone
            listening.bind(self.path)
            listening.listen(BACKLOG)
        except OSError as error:
            log.warning("no call lanes (%s): calls go over the worker socket", error)
            listening.close()
            return
        listening.setblocking(False)
        self._listening = listening
        self._loop.add_reader(listening.fileno(), self._accept)

    @property
    def listening(self) -> bool:
        return self._listening is not None

    def send(self, peer: bytes, frames: Sequence[Any]) -> bool:
        """Sends a message over the worker's lane; False if it did not go (no lane, too big, full)."""
        lane = self._lanes.get(peer)
        if lane is None or not lanes.send(lane, frames):
            return False
        self._counts[peer][0] += 1
        return True

    def has(self, peer: bytes) -> bool:
        """Whether the worker has a lane (named, not closed)."""
        return peer in self._lanes

    def sent(self, peer: bytes) -> int:
        """The messages sent over the worker's lane so far (0 without one)."""
        counts = self._counts.get(peer)
        return 0 if counts is None else counts[0]

    def messages(self, peer: bytes) -> list[int] | None:
        """[to it, from it]: the messages that crossed the worker's lane; None if it has none."""
        counts = self._counts.get(peer)
        return None if counts is None else list(counts)

    def drain(self, peer: bytes, on_message: OnMessage | None = None) -> None:
        """Hands on what the worker sent over its lane (to `on_message` instead of the lanes' own,
        if given): before a message of its from the socket, or once it has died."""
        lane = self._lanes.get(peer)
        if lane is not None:
            self._read(peer, lane, on_message or self._on_message)

    def forget(self, peer: bytes) -> None:
        self._counts.pop(peer, None)
        lane = self._lanes.pop(peer, None)
        if lane is not None:
            self._close(lane)

    def close(self) -> None:
        for lane in [*self._lanes.values(), *self._unnamed]:
            self._close(lane)
        self._lanes.clear()
        self._counts.clear()
        self._unnamed.clear()
        if self._listening is not None:
            self._close(self._listening)
            self._listening = None
            with contextlib.suppress(OSError):
                os.unlink(self.path)

    def _accept(self) -> None:
        assert self._loop is not None and self._listening is not None
        while True:
            try:
                lane, _ = self._listening.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:  # out of descriptors
                log.warning(
                    "could not accept a worker's call lane (again in %g s): %s", ACCEPT_PAUSE_SECONDS, error
                )
                self._loop.remove_reader(self._listening.fileno())
                self._loop.call_later(ACCEPT_PAUSE_SECONDS, self._accept_again)
                return
            lane.setblocking(False)
            self._unnamed.add(lane)
            self._loop.add_reader(lane.fileno(), self._name, lane)

    def _accept_again(self) -> None:
        if self._loop is not None and self._listening is not None:  # not closed meanwhile
            self._loop.add_reader(self._listening.fileno(), self._accept)

    def _name(self, lane: socket.socket) -> None:
        """The lane's first packet names its worker."""
        assert self._loop is not None
        packets = lanes.receive_one(lane)
        if packets == []:
            return
        self._unnamed.discard(lane)
        self._loop.remove_reader(lane.fileno())
        if packets is None or not 0 < len(packets[0]) <= lanes.IDENTITY_MAX:
            lane.close()  # its worker died as it started, or it is not one of ours
            return
        peer = packets[0]
        connected_pid, _, _ = _PEER_CREDENTIALS.unpack(
            lane.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
        )
        expected = self._pid_of(peer)
        if expected is not None and expected != connected_pid:
            log.warning(
                "closed a call lane from pid %d naming worker %r (pid %d)", connected_pid, peer, expected
            )
            lane.close()
            return
        self.forget(peer)
        self._lanes[peer] = lane
        self._counts[peer] = [0, 0]
        self._loop.add_reader(lane.fileno(), self._read, peer, lane, self._on_message)

    def _read(self, peer: bytes, lane: socket.socket, on_message: OnMessage) -> None:
        packets = lanes.receive(lane)
        if packets is None:  # the worker is gone: the pool hears of it from its process sentinel
            if self._lanes.get(peer) is lane:
                self.forget(peer)
            return
        self._counts[peer][1] += len(packets)
        for data in packets:
            try:
                frames = lanes.frames_of(data)
            except lanes.LaneError as error:
                log.error("dropping a malformed message from worker %r's lane: %s", peer, error)
                continue
            on_message(peer, frames)

    def _close(self, sock: socket.socket) -> None:
        assert self._loop is not None
        self._loop.remove_reader(sock.fileno())
        sock.close()
