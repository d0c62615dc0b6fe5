"""The message schema between the front and its workers; both sides import it.

Transport: the front binds one ZeroMQ ROUTER socket on ipc://RUNTIME_DIR/…;
each worker connects a DEALER whose routing identity is its worker id. A
message is a list of frames:

    [header, payload, payload, ...]

`header` is a msgpack map (never pickle) with at least:

    v   PROTOCOL_VERSION; a worker with another version is refused
    op  one of the OP_* names below
    id  request id chosen by the front (0 for one-way messages);
        a reply carries the id of its request

Payload frames carry raw bytes (request and response protobufs, tensors) so
that nothing big is ever packed into msgpack. The ROUTER adds and strips the
worker identity frame in front of the header on the front's side.

Messages:

    worker -> front   hello  {pid}                    worker is connected and idle
    front  -> worker  load   {id, model_id, format, path, pack}
                             pack: the worker may hold other models too
    front  -> worker  drop   {id, model_id}          a pack ends one model
    front  -> worker  call   {id, model, method, deadline, unanswered} + [request bytes]
                             model: the model id it is for;
                             deadline: epoch seconds after which the call
                             must not run (None: no deadline);
                             unanswered: the model's calls unanswered or
                             in line at the front as it sends this one,
                             this one included, per replica (batching.py)
    worker -> front   reply  {id, ok, error?, message?, append_field?}
                             + [response bytes, extra bytes...]
                             append_field: the front appends each extra
                             frame to the response as this repeated bytes
                             field (raw tensors travel as their own frames)

Any message with payloads may carry the header field `ring`: its big
payload frames are then in shared memory instead (workers/rings.py). A
message the front sends over the socket to a worker with a call lane carries
`lane`: how many messages it sent over the lane before it (workers/lanes.py),
which the worker takes first.

A failed reply names an error kind (ERROR_* below); the front turns kinds
into gRPC status codes in exactly one place (runtime/status.py).

Liveness travels outside the socket: each worker stamps its slot of the beat
file (`map_beats` below, runtime/beats.py) and no message is sent for it.
"""

from __future__ import annotations

import mmap
import zlib
from collections.abc import Callable, Sequence
from typing import Any, Final

import msgpack
import zmq

PROTOCOL_VERSION = 3

# The front hands the fork server its WORKER_PRELOAD list through this
# environment variable: multiprocessing starts the fork server, which offers
# no other way in.
PRELOAD_ENV = "MESH_WORKER_PRELOAD"
FORKSERVER_GROUP_ENV = "MESH_FORKSERVER_GROUP"  # which fork server this is: "base" or its framework

OP_HELLO = "hello"
OP_LOAD = "load"
OP_DROP = "drop"
OP_CALL = "call"
OP_REPLY = "reply"
OPS = frozenset({OP_HELLO, OP_LOAD, OP_DROP, OP_CALL, OP_REPLY})
LANE_FIELD = "lane"  # in a socket message: the messages sent over the call lane before it

# Error kinds a worker may put in a failed reply.
ERROR_LOAD = "load"  # the model's code raised while loading
ERROR_INVALID_INPUT = "invalid_input"  # the request does not fit the model (tensors, shapes)
ERROR_MODEL = "model"  # the model's code raised while serving
ERROR_UNIMPLEMENTED = "unimplemented"  # the model does not serve this method
ERROR_NOT_LOADED = "not_loaded"  # a call reached a worker that holds no model
ERROR_EXPIRED = "expired"  # the call's deadline passed before it could run
ERROR_PROTOCOL = "protocol"  # the message did not follow this schema (a payload the worker cannot find)
ERROR_KINDS = frozenset(
    {
        ERROR_LOAD,
        ERROR_INVALID_INPUT,
        ERROR_MODEL,
        ERROR_UNIMPLEMENTED,
        ERROR_NOT_LOADED,
        ERROR_EXPIRED,
        ERROR_PROTOCOL,
    }
)

# Methods the worker serves itself; any other method goes to the model's handle().
METHOD_INFER = "inference.GRPCInferenceService/ModelInfer"
METHOD_METADATA = "inference.GRPCInferenceService/ModelMetadata"


# The beat file: an array of float64, two per worker's slot. The first is the
# time.monotonic() of that worker's last beat: CLOCK_MONOTONIC is one clock for
# the whole machine, so the front compares a stamp with its own time. The
# second says what a pack's main thread runs: the model_tag() of the model whose
# call or load it is in, else NOTHING_RUNNING; so when a pack dies, the front
# knows which model's code killed it. An aligned 8-byte store is one
# instruction: a reader never sees half a stamp.
BEAT_FORMAT: Final = "d"
FIELDS_PER_SLOT = 2
BEAT_BYTES = 8 * FIELDS_PER_SLOT  # per slot
NOTHING_RUNNING = 0.0


def beat_index(slot: int) -> int:
    """Where a slot's last beat is in the mapped beat file."""
    return slot * FIELDS_PER_SLOT


def running_index(slot: int) -> int:
    """Where a slot's running model is in the mapped beat file."""
    return slot * FIELDS_PER_SLOT + 1


def model_tag(model_id: str) -> float:
    """A model's number in a slot's running field: its id's CRC-32 plus one, exact in a float64."""
    return float(zlib.crc32(model_id.encode()) + 1)


def map_beats(path: str | None) -> memoryview[float]:
    """The beat file as it is now, mapped for writing; index it by beat_index() and running_index().

    The file only grows (runtime/beats.py), so a slot inside this mapping
    stays inside the file for good. Without a path (a worker run with no
    front, by a benchmark or a test) this is one slot that nobody reads.
    """
    if path is None:
        return memoryview(bytearray(BEAT_BYTES)).cast(BEAT_FORMAT)
    with open(path, "r+b") as beats:
        mapped = mmap.mmap(beats.fileno(), 0)  # the mapping outlives the file descriptor
    return memoryview(mapped).cast(BEAT_FORMAT)


class ProtocolError(ValueError):
    """A frame that does not follow this schema."""


# One packer for every header: msgpack.packb builds a new one per call, which
# costs a third of the packing. Packing runs in C under the GIL, so the call
# threads of a WORKER_THREADS worker can share it.
_packer = msgpack.Packer()


def header(op: str, request_id: int = 0, **fields: Any) -> bytes:
    """Packs a header frame."""
    return header_of(op, request_id, fields)


def header_of(op: str, request_id: int, fields: dict[str, Any]) -> bytes:
    """header() for fields the caller holds in a dict of its own already, which this adds to: the
    front sends every call's this way, without a copy of the dict through keyword arguments."""
    fields["v"], fields["op"], fields["id"] = PROTOCOL_VERSION, op, request_id
    return _packer.pack(fields)


def pack_fields(fields: dict[str, Any]) -> bytes:
    """Packs a header's fields as they are (a header unpacked and added to)."""
    return _packer.pack(fields)


def reply(request_id: int, **fields: Any) -> bytes:
    """Packs a successful reply header."""
    return header(OP_REPLY, request_id, ok=True, **fields)


def reply_packer(**fields: Any) -> Callable[[int], bytes]:
    """reply(request_id, **fields) for fields fixed once: the map is packed here, and each reply
    only appends its id. A worker writes such a header for every call, and packing the whole
    map (with the keyword arguments on the way) costs about nine times that (callgrind)."""
    packed = reply(0, **fields)
    # header() puts "id" last, and msgpack writes 0 as the one byte 0x00: all but it is the same for every id.
    assert packed.endswith(b"\xa2id\x00"), packed
    prefix, pack = packed[:-1], _packer.pack

    def packed_reply(request_id: int) -> bytes:
        return prefix + pack(request_id)

    return packed_reply


def error_reply(request_id: int, kind: str, message: str) -> bytes:
    """Packs a failed reply header naming an ERROR_* kind. The message comes from model code and
    may hold what no UTF-8 can (a lone surrogate, as os.listdir() makes of an undecodable name):
    written as its escape, so that packing it cannot fail and take the worker down."""
    assert kind in ERROR_KINDS, kind
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return header(OP_REPLY, request_id, ok=False, error=kind, message=message)


# A failed reply's message goes into the worker's log, the front's and the status (which holds
# 1 KiB of it, runtime/status.py): model code may put megabytes in an exception (a data frame).
ERROR_MESSAGE_MAX_CHARS = 4096


def described(error: BaseException) -> str:
    """`Type: message` for a failed reply, at most ERROR_MESSAGE_MAX_CHARS; the type alone for an
    exception without a message (an empty pickle's EOFError). Formatting cannot fail: the message
    comes from model code, whose __str__ may raise, and would take the worker down with it."""
    try:
        text = str(error)
    except BaseException:
        text = "<exception str() failed>"  # as Python's own traceback says
    told = f"{type(error).__name__}: {text}" if text else type(error).__name__
    if len(told) <= ERROR_MESSAGE_MAX_CHARS:
        return told
    return f"{told[:ERROR_MESSAGE_MAX_CHARS]}... ({len(told) - ERROR_MESSAGE_MAX_CHARS} more characters)"


def parse_header(frame: bytes | memoryview) -> dict[str, Any]:
    """Unpacks and checks a header frame; raises ProtocolError when it is not one of ours."""
    try:
        fields = msgpack.unpackb(frame)
    except Exception as error:  # msgpack raises several unrelated types
        raise ProtocolError(f"header is not msgpack: {error}") from None
    if not isinstance(fields, dict):
        raise ProtocolError("header is not a map")
    if fields.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {fields.get('v')!r}, expected {PROTOCOL_VERSION}")
    if fields.get("op") not in OPS:
        raise ProtocolError(f"unknown op {fields.get('op')!r}")
    if not isinstance(fields.get("id"), int):
        raise ProtocolError("request id is not an integer")
    return fields


def split(frames: Sequence[Any]) -> tuple[dict[str, Any], list[Any]]:
    """[header, *payloads] -> (header fields, payload frames)."""
    if not frames:
        raise ProtocolError("empty message")
    return parse_header(frames[0]), list(frames[1:])


# -- moving frames: the hot path of both sides ------------------------------------------
#
# pyzmq's sugar (send_multipart, recv_multipart, getsockopt) turns flags into
# enum members and checks every frame in Python; its backend methods with
# plain ints cost a third as much (several µs a message, scripts/bench).
# Even the backend's getsockopt builds an enum member for the option, which
# costs three times what the call does (callgrind: 10k instructions for one
# EVENTS check): so readiness comes from zmq_poll, and "more frames follow"
# from the frame itself.

_send = zmq.backend.Socket.send
_recv = zmq.backend.Socket.recv
_poll = zmq.backend.zmq_poll
NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)
_POLLIN = int(zmq.POLLIN)
# Smaller frames are copied into ZeroMQ: cheaper than pinning a Python buffer.
COPY_BELOW = 64 * 1024


def send_frames(socket: zmq.Socket, frames: Sequence[Any], flags: int = 0) -> None:
    """Sends one message made of `frames` (bytes or buffers).

    Only a big bytes object goes without a copy: ZeroMQ's I/O thread sends it later, and a buffer
    (a view of a model's output array, say) may be written again by then, by the next call."""
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        in_place = type(frame) is bytes and len(frame) >= COPY_BELOW
        _send(socket, frame, flags | _SNDMORE if index < last else flags, copy=not in_place)


def readable(socket: zmq.Socket) -> bool:
    """Whether a message waits on `socket` (this also clears its descriptor's edge)."""
    return bool(_poll([(socket, _POLLIN)], 0))


class Waiter:
    """Sockets (or file descriptors) to wait on until one holds a message (or is readable);
    zmq_poll's items are built once, not on every wait."""

    def __init__(self, sockets: Sequence[zmq.Socket | int]):
        self._items = [(socket, _POLLIN) for socket in sockets]

    def add(self, socket: zmq.Socket | int) -> None:
        self._items.append((socket, _POLLIN))

    def discard(self, socket: zmq.Socket | int) -> None:
        self._items = [item for item in self._items if item[0] is not socket and item[0] != socket]

    def wait(self, timeout_ms: int) -> list[zmq.Socket | int]:
        """Those that are ready, waiting up to timeout_ms for one. zmq_poll looks before it
        sleeps, so a message already queued costs no wait."""
        return [socket for socket, _ in _poll(self._items, timeout_ms)]


def receive_frames(socket: zmq.Socket, copied: int) -> list:
    """The next message (call once readable()): its first `copied` frames as bytes,
    the rest left in ZeroMQ's buffers as zmq.Frame (tensors are read in place)."""
    frame = _recv(socket, NOBLOCK, copy=False)
    # bytes, then zmq.Frame from index `copied` on: no list type says which is which.
    frames: list[Any] = [frame.bytes]
    while frame.more:
        frame = _recv(socket, NOBLOCK, copy=False)
        frames.append(frame.bytes if len(frames) < copied else frame)
    return frames
