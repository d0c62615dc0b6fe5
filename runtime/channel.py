"""The front's side of the worker sockets: one ZeroMQ ROUTER, many worker DEALERs.

`request()` sends a header and payload frames to one worker and awaits the
reply with the same request id. Every message a worker sends, replies
included, is shown to the `on_event` callback first (hello, pong, liveness). `fail_peer()` fails every request still
waiting on a worker that died, so no caller waits on a dead process.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
from typing import Any, Callable, Sequence

import zmq

from workers import protocol

log = logging.getLogger("mesh.channel")


class PeerGone(Exception):
    """The worker a request went to died before replying."""

    def __init__(self, exit_code: int | None):
        super().__init__(f"worker exited ({exit_code})")
        self.exit_code = exit_code


class Channel:
    """The ROUTER socket, driven from the event loop without zmq.asyncio.

    A plain socket whose file descriptor the loop watches costs about half as
    much CPU per round trip as zmq.asyncio's futures (scripts/bench showed
    the hop dominating the front's time). ZeroMQ's descriptor is
    edge-triggered: it only says "something changed", so every wake-up, and
    every send (which may swallow an edge), drains all that is readable.
    """

    def __init__(self, address: str, on_event: Callable[[bytes, dict], None]):
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
        self._pending: dict[int, tuple[bytes, asyncio.Future]] = {}
        self._by_peer: dict[bytes, set[int]] = {}
        self._fd = self._socket.getsockopt(zmq.FD)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._fd, self._drain)
        self._loop.call_soon(self._drain)  # anything that arrived before we watched

    async def close(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._fd)
        self._socket.close(linger=0)
        self._context.term()

    def send(self, peer: bytes, header: bytes, payloads: Sequence[Any] = ()) -> None:
        """One-way message; raises PeerGone if the worker is not connected."""
        try:
            self._socket.send_multipart([peer, header, *payloads], zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH:
                raise PeerGone(None) from None
            raise
        finally:
            self._drain()  # the send may have swallowed the descriptor's edge

    def submit(self, peer: bytes, op: str, payloads: Sequence[Any] = (), **fields: Any) -> asyncio.Future:
        """Sends op to the worker; the future resolves to its (reply header, payload buffers).

        The future lives until the worker answers or dies, whoever stops
        waiting for it: callers that give up shield it, so that the worker's
        work is accounted for until it is really over.
        """
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = (peer, future)
        self._by_peer.setdefault(peer, set()).add(request_id)
        future.add_done_callback(lambda _: self._forget(peer, request_id))
        try:
            self.send(peer, protocol.header(op, request_id, **fields), payloads)
        except PeerGone as gone:
            future.set_exception(gone)
        return future

    async def request(self, peer: bytes, op: str, payloads: Sequence[Any] = (), **fields: Any
                      ) -> tuple[dict, list]:
        """submit(), awaited; a caller that is cancelled cancels the request too."""
        return await self.submit(peer, op, payloads, **fields)

    def _forget(self, peer: bytes, request_id: int) -> None:
        self._pending.pop(request_id, None)
        waiting = self._by_peer.get(peer)
        if waiting is not None:
            waiting.discard(request_id)
            if not waiting:
                del self._by_peer[peer]

    def fail_peer(self, peer: bytes, exit_code: int | None) -> None:
        """Fails every request waiting on `peer`, which has died."""
        for request_id in list(self._by_peer.pop(peer, ())):
            _, future = self._pending.get(request_id, (None, None))
            if future is not None and not future.done():
                future.set_exception(PeerGone(exit_code))

    def _drain(self) -> None:
        while self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            try:
                self._dispatch(frames)
            except protocol.ProtocolError as error:
                log.error("dropping a malformed message from worker %r: %s", frames[0].bytes, error)

    def _dispatch(self, frames: list) -> None:
        peer = frames[0].bytes
        header, payloads = protocol.split([frame.buffer for frame in frames[1:]])
        self._on_event(peer, header)  # every message proves the worker alive
        if header["op"] != protocol.OP_REPLY:
            return
        peer_and_future = self._pending.get(header["id"])
        if peer_and_future is None or peer_and_future[0] != peer or peer_and_future[1].done():
            return  # given up on, or a reply from a worker the request did not go to
        peer_and_future[1].set_result((header, payloads))  # views over the frames: copied once, by the caller
