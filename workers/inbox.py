"""What the front sent a worker, from its call lane and its socket, in the order the front sent it.

Small calls come over the lane (workers/lanes.py); loads, drops, big calls
and any message the lane could not take at once come over the ZeroMQ socket.
Whatever the front put on the lane before a socket message is on the lane
before that message arrives, and the socket message says how many that was
(its `lane` field): those are taken before it, the ones sent after it after
it. So calls sent before a drop are answered before it, and a worker runs
its calls in the order sent, as the front's overdue clocks take it to.

A worker of a row-wise model takes every message already queued before it
polls again, so calls that arrived together may share one predict
(workers/batching.py); any other takes one message per wake-up (the next poll
finds a queued one without waiting), so that the loop stamps its beat between
two slow calls. A wake that finds the socket ready takes its message: a lane
a busy front keeps full must not hold it back.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from workers import batching, lanes, protocol
from workers.holding import Holdings

log = logging.getLogger("mesh.worker")

Message = tuple[bytes, list]  # the header frame, the payloads (bytes off the lane, views of ZeroMQ's buffers)


class Inbox:
    def __init__(
        self,
        sock: zmq.Socket,
        lane: socket.socket | None,
        models: Holdings,
        note_sizes: Callable[[Sequence], None],
        batch_max: int,
        batch_wait: float,
        lane_closed: Callable[[int], None] = lambda fd: None,
    ):
        """batch_wait: seconds a row-wise model's worker may wait for one more call (0: never);
        lane_closed(fd): told as the lane closes, before its descriptor is (stop polling it)."""
        self.lane_closed = lane_closed
        self.socket = sock
        self.lane = lane
        self.lane_fd = lane.fileno() if lane is not None else -1
        self.models = models
        self.note_sizes = note_sizes
        self.batch_max = batch_max
        self.batch_wait = batch_wait
        self.last_batch = 0  # messages taken at the last wake-up
        self.lane_taken = 0  # packets taken from the lane, as the front counts those it sent

    def waited_on(self) -> list[Any]:
        """What the worker's poll waits on for messages: the socket, and the lane's descriptor."""
        return [self.socket] if self.lane is None else [self.socket, self.lane_fd]

    def take(self, ready: Sequence[Any]) -> list[Message]:
        """The messages to handle now, in order, given what the poll found `ready`."""
        messages: list[Message] = []
        every = self.models.batches_rows
        if self.socket in ready:
            # Taken at every wake that finds it ready: a busy front refills the lane faster than
            # one message a wake empties it, and a drop or a load would wait behind it for ever.
            messages = self._from_socket()
            if every:
                messages += self._from_lane(every=True)
        elif self.lane_fd in ready:
            messages = self._from_lane(every)
            if every and messages and self._wait_for_another(messages[-1][0], len(messages)):
                messages += self._from_lane(every=True)
        self.last_batch = len(messages)
        return messages

    def _from_lane(self, every: bool) -> list[Message]:
        if self.lane is None:
            return []
        packets = lanes.receive(self.lane) if every else lanes.receive_one(self.lane)
        if packets is None:  # the front closed it: it is gone or going (workers/frontwatch.py sees to that)
            self._close_lane()
            return []
        self.lane_taken += len(packets)
        messages = []
        for data in packets:
            try:
                header, *payloads = lanes.frames_of(data)
            except lanes.LaneError as error:
                log.error("dropping a malformed message from the lane: %s", error)
                continue
            messages.append((header, payloads))
        return messages

    def _close_lane(self) -> None:
        assert self.lane is not None
        log.info("the call lane closed (the front is stopping, or gone); calls come over the socket")
        self.lane_closed(self.lane_fd)
        self.lane.close()
        self.lane, self.lane_fd = None, -1

    def _from_socket(self) -> list[Message]:
        messages: list[Message] = []
        waited = False
        while True:
            header, *payloads = protocol.receive_frames(self.socket, copied=1)
            messages += self._sent_before(header)
            # Views of ZeroMQ's buffers: arrays are built over them without a copy.
            messages.append((header, [frame.buffer for frame in payloads]))
            self.note_sizes(payloads)
            # Other models gain nothing from seeing the queue, and the next poll looks anyway.
            if not self.models.batches_rows:
                break
            if not protocol.readable(self.socket):
                if waited or not self._wait_for_another(header, len(messages)):
                    break
                waited = True  # once a wake-up
                if not protocol.readable(self.socket):
                    break
        return messages

    def _sent_before(self, header: bytes) -> list[Message]:
        """The lane's messages the front sent before the socket message of `header`, which come
        first: the front takes a worker to begin its calls in the order sent (its overdue clocks)."""
        if self.lane is None:
            return []
        try:
            sent = protocol.parse_header(header).get(protocol.LANE_FIELD, 0)
        except protocol.ProtocolError:
            return []  # handle() says what is wrong with it
        messages: list[Message] = []
        while self.lane is not None and self.lane_taken < sent:
            taken = self.lane_taken
            messages += self._from_lane(every=False)
            if self.lane_taken == taken:  # sent before the socket message, so always there
                break
        return messages

    def _wait_for_another(self, header: bytes, held: int) -> bool:
        """Sleeps batch_wait when another call is likely to come (workers/batching.py); True if it
        waited."""
        if self.batch_wait <= 0:
            return False
        if not batching.worth_waiting(held, self.last_batch, self.batch_max, header, self.models.row_wise):
            return False
        time.sleep(self.batch_wait)
        return True
