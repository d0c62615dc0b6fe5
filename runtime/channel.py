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
import zmq.asyncio

from workers import protocol

log = logging.getLogger("mesh.channel")


class PeerGone(Exception):
    """The worker a request went to died before replying."""

    def __init__(self, exit_code: int | None):
        super().__init__(f"worker exited ({exit_code})")
        self.exit_code = exit_code


class Channel:
    def __init__(self, address: str, on_event: Callable[[bytes, dict], None]):
        self.address = address
        self._on_event = on_event
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        # Raise instead of silently dropping a message for an unknown worker.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.bind(address)
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future] = {}
        self._by_peer: dict[bytes, set[int]] = {}
        self._receiver: asyncio.Task | None = None

    def start(self) -> None:
        self._receiver = asyncio.create_task(self._receive_forever(), name="channel-receiver")

    async def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        self._socket.close(linger=0)
        self._context.term()

    async def send(self, peer: bytes, header: bytes, payloads: Sequence[Any] = ()) -> None:
        """One-way message; raises PeerGone if the worker is not connected."""
        try:
            await self._socket.send_multipart([peer, header, *payloads], copy=False)
        except zmq.ZMQError as error:
            if error.errno == zmq.EHOSTUNREACH:
                raise PeerGone(None) from None
            raise

    async def request(self, peer: bytes, op: str, payloads: Sequence[Any] = (), **fields: Any
                      ) -> tuple[dict, list]:
        """Sends op to the worker and returns its (reply header, payload frames)."""
        request_id = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        self._by_peer.setdefault(peer, set()).add(request_id)
        try:
            await self.send(peer, protocol.header(op, request_id, **fields), payloads)
            return await future
        finally:
            self._pending.pop(request_id, None)
            waiting = self._by_peer.get(peer)
            if waiting is not None:
                waiting.discard(request_id)

    def fail_peer(self, peer: bytes, exit_code: int | None) -> None:
        """Fails every request waiting on `peer`, which has died."""
        for request_id in self._by_peer.pop(peer, ()):
            future = self._pending.get(request_id)
            if future is not None and not future.done():
                future.set_exception(PeerGone(exit_code))

    async def _receive_forever(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
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
        future = self._pending.get(header["id"])
        if future is None or future.done():
            return  # its caller gave up (cancelled or timed out)
        future.set_result((header, [frame.bytes for frame in frames[2:]]))
