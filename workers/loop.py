"""The worker's serving loop: one DEALER socket, at most one model, one request at a time.

Life of a worker (the front drives it; see workers/protocol.py for messages):

    forked by the fork server -> connect, say hello       (a warm spare)
    load    -> import the model, give scratch memory back to the OS, reply
    call    -> decode the request, run the model, reply with the response bytes
    SIGTERM -> model.close() if it has one, exit; SIGKILL when the front is in a hurry

The loop ends by itself when the front has been silent for longer than the
heartbeat timeout; the parent-death signal (workers/lifeline.py) covers the
rest.
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
from typing import Any

import zmq
from setproctitle import setproctitle

from protos import grpc_predict_v2_pb2 as pb
from workers import formats, protocol, v2

log = logging.getLogger("mesh.worker")

POLL_MS = 500


def trim_memory() -> None:
    """Hands freed heap back to the OS so the front measures what the model keeps."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc
        pass


class Worker:
    def __init__(self, config: dict[str, Any]):
        self.model: Any = None
        self.model_id = ""
        self.format = ""
        self.heartbeat_timeout = config["heartbeat_timeout"]
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, config["identity"])
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(config["address"])
        self.handlers = {
            protocol.OP_PING: self.on_ping,
            protocol.OP_LOAD: self.on_load,
            protocol.OP_CALL: self.on_call,
        }

    def serve(self) -> None:
        self.socket.send(protocol.header(protocol.OP_HELLO, pid=os.getpid()))
        last_heard = time.monotonic()
        while True:
            if not self.socket.poll(POLL_MS):
                if time.monotonic() - last_heard > self.heartbeat_timeout:
                    log.error("no word from the front for %.0f s; exiting", self.heartbeat_timeout)
                    return
                continue
            frames = self.socket.recv_multipart(copy=False)
            last_heard = time.monotonic()
            try:
                header, payloads = protocol.split([frame.buffer for frame in frames])
            except protocol.ProtocolError as error:
                log.error("dropping a malformed message: %s", error)
                continue
            handler = self.handlers.get(header["op"])
            if handler is None:
                log.error("dropping a message with op %r, which workers do not take", header["op"])
                continue
            self.socket.send_multipart(handler(header, payloads), copy=False)

    def on_sigterm(self, signum, frame) -> None:
        try:
            if self.model is not None:
                self.model.close()
        finally:
            os._exit(0)

    def on_ping(self, header: dict, payloads: list) -> list:
        return [protocol.header(protocol.OP_PONG)]

    def on_load(self, header: dict, payloads: list) -> list:
        request_id = header["id"]
        if self.model is not None:
            return [protocol.error_reply(request_id, protocol.ERROR_LOAD,
                                         f"this worker already holds model {self.model_id}")]
        self.model_id, self.format = header["model_id"], header["format"]
        setproctitle(f"mesh-runtime worker model={self.model_id}")
        started = time.monotonic()
        try:
            self.model = formats.load(self.format, header["path"])
        except Exception as error:
            log.warning("load of %s failed: %s: %s", self.model_id, type(error).__name__, error,
                        extra={"model_id": self.model_id})
            return [protocol.error_reply(request_id, protocol.ERROR_LOAD, f"{type(error).__name__}: {error}")]
        trim_memory()
        log.info("loaded %s (%s) in %.1f ms", self.model_id, self.format,
                 (time.monotonic() - started) * 1000, extra={"model_id": self.model_id})
        return [protocol.reply(request_id)]

    def on_call(self, header: dict, payloads: list) -> list:
        request_id, method = header["id"], header["method"]
        if self.model is None:
            return [protocol.error_reply(request_id, protocol.ERROR_NOT_LOADED, "no model in this worker")]
        request = bytes(payloads[0]) if payloads else b""
        try:
            body = self._dispatch(method, request)
        except v2.InvalidInput as error:
            return [protocol.error_reply(request_id, protocol.ERROR_INVALID_INPUT, str(error))]
        except _Unimplemented as error:
            return [protocol.error_reply(request_id, protocol.ERROR_UNIMPLEMENTED, str(error))]
        except Exception as error:
            log.exception("model %s raised while serving %s", self.model_id, method,
                          extra={"model_id": self.model_id})
            return [protocol.error_reply(request_id, protocol.ERROR_MODEL, f"{type(error).__name__}: {error}")]
        return [protocol.reply(request_id), body]

    def _dispatch(self, method: str, request: bytes) -> bytes:
        if method == protocol.METHOD_INFER:
            return self._infer(request)
        if method == protocol.METHOD_METADATA:
            return v2.metadata_response(self.model_id, self.format, self.model.metadata())
        if getattr(self.model, "handles_methods", False):
            return self.model.handle(method, request)
        raise _Unimplemented(f"model {self.model_id} does not serve {method}")

    def _infer(self, request_bytes: bytes) -> bytes:
        try:
            request = pb.ModelInferRequest.FromString(request_bytes)
        except Exception as error:  # protobuf's DecodeError and friends
            raise v2.InvalidInput(f"request is not a valid ModelInferRequest: {error}") from None
        inputs, parameters, raw = v2.decode_request(request)
        outputs = self.model.predict(inputs, parameters, [o.name for o in request.outputs])
        return v2.encode_response(request, outputs, raw)


class _Unimplemented(Exception):
    pass
