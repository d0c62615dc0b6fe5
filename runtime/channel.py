"""The front's side of the worker sockets: one ZeroMQ ROUTER, many worker DEALERs, and call lanes.

`submit()` sends a header and payload frames to one worker and returns a
future for the reply with the same request id. Every message a worker sends,
replies included, is shown to the `on_event` callback first (hello,
liveness). `fail_peer()` fails every request still waiting on a worker that
died, so no caller waits on a dead process.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Collection, Sequence
from typing import Any

import zmq

from runtime.busypoll import BusyPoller
from runtime.lanes import FrontLanes
from runtime.rings import FrontRings
from workers import protocol, rings

log = logging.getLogger("mesh.channel")


class PeerGone(Exception):
    """The worker a request went to died before replying."""

    def __init__(self, exit_code: int | None, cause: str = "", begun: bool = True):
        super().__init__(f"worker exited ({cause or exit_code})")
        self.exit_code = exit_code
        self.cause = cause  # why it died, where the front knows better than its exit code
        self.begun = begun  # the worker may have begun the request (see Channel._start_clocks)


class _Request:
    """A request a worker has not answered yet.

    It outlives its caller: a caller that gives up cancels `future`, but the
    request stays until the worker answers or dies, and only then runs
    `on_end` (which frees the worker's slot), because until then the worker
    is still busy with it.
    """

    __slots__ = ("peer", "future", "on_end", "overdue", "timer", "model", "over_socket")

    def __init__(
        self,
        peer: bytes,
        future: asyncio.Future,
        on_end: Callable[[], None] | None,
        overdue: tuple[float, Callable[[], BaseException]] | None,
    ):
        self.peer, self.future, self.on_end = peer, future, on_end
        self.overdue = overdue  # (seconds after the worker begins it, the error to end it with then)
        self.timer: asyncio.TimerHandle | None = None  # armed once the worker has begun it
        self.model: str | None = None  # a call's model
        self.over_socket = False  # a call sent over the socket to a worker with a lane


class Channel:
    """The ROUTER socket, driven from the event loop without zmq.asyncio.

    A plain socket whose file descriptor the loop watches costs about half as
    much CPU per round trip as zmq.asyncio's futures (scripts/bench showed
    the hop dominating the front's time). ZeroMQ's descriptor is
    edge-triggered: it only says "something changed", so every wake-up, and
    every send (which may swallow an edge), drains all that is readable.
    """

    def __init__(
        self,
        address: str,
        on_event: Callable[[bytes, dict], None],
        busy_poll_seconds: float = 0.0,
        ring_bytes: int = 0,
        runs_at_once: int = 1,
        lanes_path: str | None = None,
        pid_of: Callable[[bytes], int | None] = lambda peer: None,
    ):
        """lanes_path: where workers connect their call lanes (runtime/lanes.py), None for none;
        pid_of(peer): the worker's pid, once known, to check who connected a lane."""
        self.address = address
        self._on_event = on_event
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        # Raise instead of silently dropping a message for an unknown worker.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        # No high-water marks: sends never block (the front bounds its own queues).
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.bind(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, _Request] = {}
        self._by_peer: dict[bytes, dict[int, None]] = {}  # in the order sent
        # Workers with a lane and calls sent them over the socket, unanswered: how many. Their next
        # calls follow over the socket, which keeps them in order behind those (the lane would not).
        self._socket_calls: dict[bytes, int] = {}
        self.runs_at_once = runs_at_once  # requests a worker runs at a time (WORKER_THREADS)
        self._timed = 0  # requests pending with an overdue timer to arm (WORKER_REQUEST_TIMEOUT_MS)
        self._fd = self._socket.fileno()  # what getsockopt(zmq.FD) returns, typed int rather than int | bytes
        self._loop: asyncio.AbstractEventLoop | None = None
        self.busy_poller = BusyPoller(busy_poll_seconds, self.replies_due_soon)
        self.rings = FrontRings(ring_bytes, lambda peer: peer in self._by_peer)
        self.lanes = FrontLanes(lanes_path, self._from_lane, pid_of) if lanes_path else None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)  # anything that arrived before we watched
        if self.lanes is not None:
            self.lanes.start()

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        if self.lanes is not None:
            self.lanes.close()
        self.rings.close()
        self._socket.close(linger=0)
        self._context.term()

    @property
    def lanes_address(self) -> str | None:
        """Where a worker connects its call lane; None if the front has no lanes."""
        return self.lanes.path if self.lanes is not None and self.lanes.listening else None

    def replies_due_soon(self) -> bool:
        """Some worker owes a reply and none has a request queued behind another.

        While this holds, for BUSY_POLL_US after a request goes out, the event
        loop polls instead of sleeping (runtime/busypoll.py). A worker with a
        queue is saturated: its replies come at its own pace, and a polling
        front would only take CPU from it.
        """
        return 0 < len(self._pending) <= len(self._by_peer)

    def send(self, peer: bytes, header: bytes, payloads: Sequence[Any] = ()) -> None:
        """One-way message; raises PeerGone if the worker is not connected."""
        try:
            protocol.send_frames(self._socket, [peer, header, *payloads], protocol.NOBLOCK)
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH:
                raise PeerGone(None) from None
            raise
        finally:
            self._drain()  # the send may have swallowed the descriptor's edge

    def submit(
        self,
        peer: bytes,
        op: str,
        payloads: Sequence[Any] = (),
        on_end: Callable[[], None] | None = None,
        overdue_after: float | None = None,
        on_overdue: Callable[[], BaseException] | None = None,
        **fields: Any,
    ) -> asyncio.Future:
        """Sends op to the worker; the future resolves to its (reply header, payload frames).

        `on_end` runs once the worker has answered or died, whether or not
        anyone still waits on the future (see _Request). A request still
        unanswered `overdue_after` seconds after the worker began it ends with
        the error that `on_overdue()` returns (it is expected to end the worker
        too). A worker is taken to begin its requests in the order sent,
        `runs_at_once` at a time: one queued behind others is not overdue for
        the time it waited.
        """
        if self._loop is None:
            raise RuntimeError("Channel.submit() before start()")
        if overdue_after is not None and on_overdue is None:
            raise ValueError("overdue_after needs on_overdue, the error to end the request with")
        request_id = next(self._ids)
        future = self._loop.create_future()
        overdue = (
            (overdue_after, on_overdue) if overdue_after is not None and on_overdue is not None else None
        )
        request = self._pending[request_id] = _Request(peer, future, on_end, overdue)
        request.model = fields.get("model")
        self._by_peer.setdefault(peer, {})[request_id] = None
        if overdue is not None:
            self._timed += 1
            self._start_clocks(peer)
        try:
            # Loads and drops go over the socket, and calls behind one sent over it.
            lanes = self.lanes if op == protocol.OP_CALL and peer not in self._socket_calls else None
            if peer in self.rings.owed or _reaches(payloads, self.rings.threshold):
                payloads, ring = self.rings.outgoing(peer, payloads)
                if ring is not None:  # the ring's order is the socket's (workers/rings.py)
                    fields[rings.FIELD], lanes = ring, None
            header = protocol.header_of(op, request_id, fields)  # fields: ours
            if lanes is None or not lanes.send(peer, (header, *payloads)):
                if self.lanes is not None and self.lanes.has(peer):
                    self._note_over_socket(request, op)
                    if sent := self.lanes.sent(peer):
                        # What went over the lane before it the worker takes first (workers/inbox.py).
                        fields[protocol.LANE_FIELD] = sent
                        header = protocol.header_of(op, request_id, fields)
                self.send(peer, header, payloads)
        except PeerGone as gone:
            self._end(request_id, error=gone)
        else:
            # A load or a drop answers in milliseconds: polling would only take a core from it, and
            # from the calls meanwhile. Off (the default), not even a call to arm() per call.
            if op == protocol.OP_CALL and self.busy_poller.window_seconds > 0:
                self.busy_poller.arm()
        return future

    async def request(
        self, peer: bytes, op: str, payloads: Sequence[Any] = (), **fields: Any
    ) -> tuple[dict, list]:
        """submit(), awaited."""
        return await self.submit(peer, op, payloads, **fields)

    def ahead_of_next(self, peer: bytes) -> list[int]:
        """The requests the worker runs before one sent to it now, where it runs one at a time."""
        return list(self._by_peer.get(peer, ())) if self.runs_at_once == 1 else []

    def still_pending(self, request_ids: list[int]) -> list[int]:
        return [request_id for request_id in request_ids if request_id in self._pending]

    def owes_begun(self, peer: bytes, models: Collection[str]) -> bool:
        """Whether the worker has begun a call of one of `models` (as _start_clocks() takes it)."""
        begun = itertools.islice(self._by_peer.get(peer, ()), self.runs_at_once)
        return any(self._pending[request_id].model in models for request_id in begun)

    def _start_clocks(self, peer: bytes) -> None:
        """Arms the overdue timer of each request the worker has begun by now: the first
        `runs_at_once` of those it has not answered."""
        assert self._loop is not None  # submit() checked
        for request_id in itertools.islice(self._by_peer.get(peer, ()), self.runs_at_once):
            request = self._pending[request_id]
            if request.overdue is not None and request.timer is None:
                seconds, on_overdue = request.overdue
                request.timer = self._loop.call_later(seconds, self._overdue, request_id, on_overdue)

    def _overdue(self, request_id: int, on_overdue: Callable[[], BaseException]) -> None:
        # After a stall of the event loop the timer may fire with the reply
        # already queued unread, on the socket or the lane: read it before judging the worker.
        request = self._pending.get(request_id)
        if request is not None and self.lanes is not None:
            self.lanes.drain(request.peer)
        self._drain()
        if request_id in self._pending:
            self._end(request_id, error=on_overdue())

    def fail_peer(self, peer: bytes, exit_code: int | None, cause: str = "") -> None:
        """Fails every request waiting on `peer`, which has died, and frees its rings; each says
        whether the worker had begun it, as _start_clocks() takes it to. What it answered over its
        lane before it died is handed on first."""
        if self.lanes is not None:
            self.lanes.drain(peer, self._answer_from_the_dead)
            self.lanes.forget(peer)
        for place, request_id in enumerate(list(self._by_peer.get(peer, ()))):
            self._end(request_id, error=PeerGone(exit_code, cause, begun=place < self.runs_at_once))
        self.rings.forget(peer)

    def _end(self, request_id: int, result: Any = None, error: BaseException | None = None) -> None:
        request = self._pending.pop(request_id, None)
        if request is None:
            return
        waiting = self._by_peer.get(request.peer)
        if waiting is not None:
            waiting.pop(request_id, None)
            if not waiting:
                del self._by_peer[request.peer]
        if request.timer is not None:
            request.timer.cancel()
        if request.over_socket:
            self._socket_calls[request.peer] -= 1
            if not self._socket_calls[request.peer]:
                del self._socket_calls[request.peer]
        if request.overdue is not None:
            self._timed -= 1
        if self._timed:
            self._start_clocks(request.peer)  # the next in line has begun
        if request.on_end is not None:
            request.on_end()
        future = request.future
        if not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def _note_over_socket(self, request: _Request, op: str) -> None:
        """A call goes over the socket to a worker with a lane (too big, or the lane full)."""
        if op == protocol.OP_CALL:
            request.over_socket = True
            self._socket_calls[request.peer] = self._socket_calls.get(request.peer, 0) + 1

    def _drain(self) -> None:
        while protocol.readable(self._socket):
            frames = protocol.receive_frames(self._socket, copied=2)  # peer and header
            peer, header, payloads = frames[0], frames[1] if len(frames) > 1 else b"", frames[2:]
            if self.lanes is not None:
                self.lanes.drain(peer)  # what it sent over its lane first came first
            try:
                self._dispatch(peer, protocol.parse_header(header), payloads)
            except protocol.ProtocolError as error:
                log.error("dropping a malformed message from worker %r: %s", peer, error)

    def _from_lane(self, peer: bytes, frames: list) -> None:
        try:
            self._dispatch(peer, protocol.parse_header(frames[0]), frames[1:])
        except protocol.ProtocolError as error:
            log.error("dropping a malformed message from worker %r's lane: %s", peer, error)

    def _answer_from_the_dead(self, peer: bytes, frames: list) -> None:
        """A reply the worker sent over its lane before it died: it answers its call, and proves
        no one alive (the pool has let the worker go)."""
        try:
            header = protocol.parse_header(frames[0])
        except protocol.ProtocolError:
            return
        request = self._pending.get(header["id"])
        if header["op"] == protocol.OP_REPLY and request is not None and request.peer == peer:
            self._end(header["id"], result=(header, frames[1:]))

    def _dispatch(self, peer: bytes, header: dict, payloads: list) -> None:
        ring = header.get(rings.FIELD)
        if ring is not None:  # first, whoever waits: each ring is read in the order it was filled
            try:
                payloads = self.rings.incoming(peer, ring, payloads)
            except rings.RingError as error:
                header = self._failed_for_lost_payloads(peer, header, error)
        self._on_event(peer, header)  # every message proves the worker alive
        if header["op"] != protocol.OP_REPLY:
            return
        request = self._pending.get(header["id"])
        if request is None or request.peer != peer:
            return  # a reply from a worker the request did not go to
        self._end(header["id"], result=(header, payloads))

    def _failed_for_lost_payloads(self, peer: bytes, header: dict, error: Exception) -> dict:
        """A message whose payloads cannot be read out of the ring, as a failed reply (INTERNAL).

        A bug, unless the worker is dead and its rings gone, its last messages read only now.
        """
        request = self._pending.get(header["id"])
        waited_for = request is not None and request.peer == peer
        log.log(
            logging.ERROR if waited_for else logging.WARNING,
            "worker %r sent payloads that are not in its ring: %s",
            peer,
            error,
        )
        message = f"the worker's reply was lost on its way: {error}"
        return {**header, "ok": False, "error": protocol.ERROR_PROTOCOL, "message": message}


def _reaches(payloads: Sequence[Any], size: float) -> bool:
    """Whether any payload is `size` bytes or more, by len(): bytes for the byte strings the front
    sends. A plain loop: cheaper than max() with a default."""
    for payload in payloads:
        if len(payload) >= size:
            return True
    return False
