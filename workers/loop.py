"""The worker's serving loop: socket and call lane, its model (or a pack's), WORKER_THREADS calls at a time.

Life of a worker (the front drives it; see workers/protocol.py for messages):

    forked by the fork server -> connect, say hello       (a warm spare)
    load    -> import the model, give scratch memory back to the OS, reply
               (a pack takes several, workers/holding.py)
    call    -> decode the request, run the model it names, reply with the response bytes
    drop    -> a pack ends one of its models and gives its memory back
    SIGTERM -> each model's close(), exit; SIGKILL when the front is in a hurry

With WORKER_THREADS > 1, calls run in a thread pool, and each thread hands its
reply to the main loop over an inproc PUSH/PULL pair: ZeroMQ sockets are not
thread-safe, so only the main thread touches the DEALER (and the lane). With one
thread, calls run inline. Small calls and their replies go over the call lane,
everything else over the socket (workers/lanes.py); workers/inbox.py takes
messages from both in the order the front sent them, and several at once for a
row-wise model, whose calls that arrived together may share one predict.

Every wake of the loop stamps the worker's slot of the beat file, and an idle
worker wakes only for that every so often (workers/beatslot.py). A
call that carried a big buffer leaves free heap that glibc keeps for the next
one (plumbing/heap.py): the first wake with nothing to read after it gives that
heap back, so a worker keeps it only while its calls flow.

Payload frames of 64 KiB or more may travel through a ring in shared memory
instead of the socket, once the front has offered one (workers/rings.py).

The loop ends once the front process is gone (workers/frontwatch.py). A front
that runs but sends nothing is idle or stalled, not gone: its worker waits for
it rather than take its model down.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from plumbing import heap, lifeline, logsetup
from plumbing.shmblocks import BlockNotes
from protos import grpc_predict_v2_pb2 as pb
from protos import wire
from workers import batching, lanes, protocol, responses, rings, v2
from workers.beatslot import BeatSlot
from workers.frontwatch import FrontWatch
from workers.holding import Held, Holdings
from workers.inbox import Inbox
from workers.raised import RaisedLog

log = logging.getLogger("mesh.worker")

# The header of every ModelInfer reply: raw outputs travel as frames the front appends as this field.
_INFER_REPLY = protocol.reply_packer(append_field=v2.RAW_OUTPUT_FIELD)


class Worker:
    def __init__(self, config: dict[str, Any], blocks: BlockNotes | None = None):
        self.front_watch = FrontWatch(config.get("front"), config["heartbeat_timeout"])
        self.beats = BeatSlot(config)
        self.heap_to_trim = False  # a big buffer came or went since the heap was last given back
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, config["identity"])
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(config["address"])
        self.batch_max = config.get("batch_max", 1)
        threads = config.get("threads", 1)
        self.blocks = blocks
        self.models = Holdings(self.batch_max, threads, blocks)
        lane = lanes.connect(config["lanes"], config["identity"]) if config.get("lanes") else None
        batch_wait = config.get("batch_wait", 0.0) if threads == 1 else 0.0  # call threads do not batch
        self.inbox = Inbox(
            self.socket, lane, self.models, self.note_sizes, self.batch_max, batch_wait, self.stop_polling
        )
        self.waiter = protocol.Waiter(self.inbox.waited_on())
        if self.front_watch.pidfd is not None:
            self.waiter.add(self.front_watch.pidfd)
        self.rings = rings.WorkerRings()  # big payloads in shared memory, once the front offers it
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        if threads > 1:
            self.pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="call")
            self.replies = self.context.socket(zmq.PULL)
            self.replies.bind("inproc://replies")
            self.waiter.add(self.replies)
            self.thread_sockets = threading.local()
        self.handlers = {protocol.OP_LOAD: self.models.load, protocol.OP_DROP: self.models.drop}
        self.raised = RaisedLog()
        self.names_models_in_logs = logsetup.names_models()

    def serve(self) -> None:
        for request in v2.sample_requests():  # its first call then finds the pages it writes copied
            self._infer_reply(call := self._decode(0, request), call.inputs)
        self.beats.beat()
        self.send([protocol.header(protocol.OP_HELLO, pid=os.getpid())], over_lane=False)
        self.front_watch.start(time.monotonic())
        while True:
            # One zmq_poll both finds what is queued and waits when nothing is:
            # each readiness check costs system calls (poll, and ZeroMQ's own
            # poll and getpid), so none is repeated.
            ready = self.waiter.wait(self.beats.ms_to_next_beat())
            if not ready and self.heap_to_trim:
                self.give_heap_back()
            if messages := self.inbox.take(ready):
                self.handle(messages)
            if self.pool is not None and self.replies in ready:
                self.forward_replies()
            if self.front_watch.gone(ready, self.beats.beat()):
                log.error("the front is gone; exiting")
                return

    def stop_polling(self, fd: int) -> None:
        self.waiter.discard(fd)

    def mark_running(self, model_id: str | None, main_thread: bool = False) -> None:
        """Says which model's code this thread runs now (None: none): to its log records, to the
        shared-memory blocks it may make, and in the beat file for a pack's main thread. Call
        threads mark nothing there (several models may run at once); beside them the main thread
        still marks its own loads and drops (`main_thread`)."""
        if self.names_models_in_logs:
            logsetup.running.model_id = model_id
        if self.blocks is not None:
            self.blocks.made_by(model_id)
        if self.models.packed and (self.pool is None or main_thread):
            self.beats.mark_running(model_id)

    def give_heap_back(self) -> None:
        """Calls stopped after a big one: the free heap they left goes back to the OS."""
        heap.trim()
        self.heap_to_trim = False

    def note_sizes(self, frames: Sequence) -> None:
        # A plain loop: max() with a default parses its keyword on every call, and this runs for
        # every message in and out, at 5.0 k instructions a message against 1.5 k (callgrind).
        if self.heap_to_trim:
            return
        for frame in frames:
            if len(frame) >= heap.TRIM_AFTER_BYTES:
                self.heap_to_trim = True
                return

    def send(self, frames: list, over_lane: bool = True) -> None:
        """Sends one message to the front (frames: header, then payloads); a call's reply over the
        lane when it fits, anything else over the socket (`over_lane` False: workers/inbox.py)."""
        self.note_sizes(frames)
        lane = self.inbox.lane if over_lane else None
        if self.rings.in_use:
            ringed = self.rings.outgoing(frames)
            if ringed is not frames:  # the ring's field: its order is the socket's (workers/rings.py)
                frames, lane = ringed, None
        if lane is None or not lanes.send(lane, frames):
            protocol.send_frames(self.socket, frames)

    def forward_replies(self) -> None:
        """Passes the reply the poll found, and any other the call threads finished, on to the front."""
        while True:
            self.send(self.replies.recv_multipart(copy=False))
            if not protocol.readable(self.replies):
                break

    def handle(self, messages: list[tuple[bytes, list]]) -> None:
        """Answers messages in order; a row-wise model's calls that arrived together go to replies_as_made."""
        calls: list[tuple[dict, list]] = []
        for header_frame, payloads in messages:
            try:
                header = protocol.parse_header(header_frame)
            except protocol.ProtocolError as error:
                log.error("dropping a malformed message: %s", error)
                continue
            if rings.FIELD in header:
                copied_out = self.out_of_ring(header, payloads)
                if copied_out is None:
                    continue
                payloads = copied_out
            op = header["op"]
            if op == protocol.OP_CALL and self.pool is not None:
                self.pool.submit(self.call_in_thread, header, payloads)
            elif op == protocol.OP_CALL and self.models.batches_rows:
                calls.append((header, payloads))  # may share a predict with the calls after it
            elif op == protocol.OP_CALL:
                self.send(self.on_call(header, payloads))  # answered at once, not after the rest
            elif op in self.handlers:
                for _, reply in self.replies_as_made(calls):  # calls that came first are answered first
                    self.send(reply)
                calls = []
                self.mark_running(header.get("model_id"), main_thread=True)  # a load, or a drop and close()
                reply = self.handlers[op](header, payloads)
                self.mark_running(None, main_thread=True)  # not if it raised: the worker dies of it
                self.send(reply, over_lane=False)
            else:
                log.error("dropping a message with op %r, which workers do not take", op)
        if calls:
            for _, reply in self.replies_as_made(calls):
                self.send(reply)

    def out_of_ring(self, header: dict, payloads: list) -> list | None:
        """The payloads with those in the ring copied out; None if they cannot be, the call failed."""
        try:
            payloads = self.rings.receive(header[rings.FIELD], payloads)
        except rings.RingError as error:  # the call fails rather than wait for an answer forever
            log.error("a message's payloads are not in the ring: %s", error)
            self.send([protocol.error_reply(header["id"], protocol.ERROR_PROTOCOL, str(error))])
            return None
        self.note_sizes(payloads)
        return payloads

    def call_in_thread(self, header: dict, payloads: list) -> None:
        try:
            reply = self.on_call(header, payloads)
        except BaseException as error:  # SystemExit and friends from model code: still answer
            reply = [protocol.error_reply(header["id"], protocol.ERROR_MODEL, protocol.described(error))]
        push = getattr(self.thread_sockets, "push", None)
        if push is None:
            push = self.thread_sockets.push = self.context.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 0)
            push.connect("inproc://replies")
        push.send_multipart(reply, copy=False)

    def on_sigterm(self, signum, frame) -> None:
        try:
            self.models.close_all()
        finally:
            lifeline.kill_children()
            os._exit(0)

    def replies_as_made(self, calls: list[tuple[dict, list]]) -> Iterator[tuple[int, list]]:
        """(request id, reply) of each of the calls that were queued together, as soon as it is made:
        the front times a call from when its worker begins it, when the one before is answered.

        A row-wise model predicts alike ModelInfer calls at once
        (workers/batching.py); every other call runs on its own.
        """
        if len(calls) < 2 or not self.models.batches_rows:
            for header, payloads in calls:
                yield header["id"], self.on_call(header, payloads)
            return
        decoded: list[batching.InferCall] = []
        for header, payloads in calls:
            call = self._decoded_for_batch(header, payloads)
            if call is None:
                yield header["id"], self.on_call(header, payloads)
            else:
                decoded.append(call)
        for group in batching.groups(decoded, self.batch_max):
            yield from self._predict_group(group).items()

    def on_call(self, header: dict, payloads: list) -> list:
        request_id, method = header["id"], header["method"]
        held = self.models.find(header.get("model"))
        refusal = self._refusal(header, held)
        if refusal is not None or held is None:
            return refusal or []  # _refusal() answers every call without a model
        request = payloads[0] if payloads else b""
        self.mark_running(held.model_id)
        reply = self._answer(held, request_id, method, self._dispatch, held, request_id, method, request)
        self.mark_running(None)
        return reply

    def _refusal(self, header: dict, held: Held | None) -> list | None:
        """The reply to a call that must not run (its model not here, deadline passed), else None."""
        if held is None:
            wanted = header.get("model")
            message = f"model {wanted} is not in this worker" if wanted else "no model in this worker"
            return [protocol.error_reply(header["id"], protocol.ERROR_NOT_LOADED, message)]
        deadline = header.get("deadline")
        if deadline is not None and time.time() > deadline:
            return [
                protocol.error_reply(
                    header["id"], protocol.ERROR_EXPIRED, "the request's deadline passed before it could run"
                )
            ]
        return None

    def _answer(self, held: Held, request_id: int, method: str, work, *arguments) -> list:
        """work(*arguments)'s reply frames, or the failed reply naming what went wrong."""
        try:
            return work(*arguments)
        except v2.InvalidInput as error:
            return [protocol.error_reply(request_id, protocol.ERROR_INVALID_INPUT, str(error))]
        except _Unimplemented as error:
            return [protocol.error_reply(request_id, protocol.ERROR_UNIMPLEMENTED, str(error))]
        except BaseException as error:  # sys.exit() and the like in model code fail its call alone
            self.raised.note(held.model_id, method, error)
            return [protocol.error_reply(request_id, protocol.ERROR_MODEL, protocol.described(error))]

    def _dispatch(self, held: Held, request_id: int, method: str, request) -> list:
        if method == protocol.METHOD_INFER:
            call = self._decode(request_id, request, held)
            return self._infer_reply(call, self._predict(call, call.inputs))
        if method == protocol.METHOD_METADATA:
            body = responses.metadata_response(held.model_id, held.format, held.model.metadata())
        elif getattr(held.model, "handles_methods", False):
            body = held.model.handle(method, bytes(request))
            if not isinstance(body, (bytes, bytearray, memoryview)):  # ZeroMQ would raise on sending it
                raise TypeError(f"handle() returned {type(body).__name__}, expected bytes")
        else:
            raise _Unimplemented(f"model {held.model_id} does not serve {method}")
        return [protocol.reply(request_id), body]

    def _decode(self, request_id: int, request_bytes, held: Held | None = None) -> batching.InferCall:
        try:
            if len(request_bytes) < protocol.COPY_BELOW:
                # Small: protobuf parses it whole faster than Python walks its fields,
                # and copying a few raw bytes costs nothing.
                request, raw_inputs = pb.ModelInferRequest.FromString(request_bytes), None
            else:
                # The raw tensors stay views over the received frame; protobuf parses the rest.
                rest, raw_inputs = wire.split_bytes_field(request_bytes, v2.RAW_INPUT_FIELD)
                request = pb.ModelInferRequest.FromString(rest)
        except Exception as error:  # WireError, protobuf's DecodeError and friends
            raise v2.InvalidInput(f"request is not a valid ModelInferRequest: {error}") from None
        inputs, parameters, raw = v2.decode_request(request, raw_inputs)
        requested = v2.output_names(request)
        return batching.InferCall(request_id, request, inputs, parameters, raw, requested, held)

    @staticmethod
    def _predict(call: batching.InferCall, inputs: dict):
        assert call.held is not None  # only the spare's rehearsal decodes without a model, and never predicts
        return call.held.model.predict(inputs, call.parameters, call.requested)

    @staticmethod
    def _infer_reply(call: batching.InferCall, outputs) -> list:
        body, buffers = responses.encode_response_parts(call.request, outputs, call.raw, call.requested)
        return [_INFER_REPLY(call.request_id), body, *buffers]

    def _decoded_for_batch(self, header: dict, payloads: list) -> batching.InferCall | None:
        """A ModelInfer call that may share a predict, decoded; None for one that must run alone."""
        held = self.models.find(header.get("model"))
        if header["method"] != protocol.METHOD_INFER or self._refusal(header, held) is not None:
            return None
        try:
            return self._decode(header["id"], payloads[0] if payloads else b"", held)
        except Exception:
            return None  # on_call decodes it again and says what is wrong

    def _predict_group(self, group: list[batching.InferCall]) -> dict[int, list]:
        """Replies to a group of alike calls by request id: one predict, or one each if that fails."""
        held = group[0].held  # a group's calls are for one model (batching.groups)
        assert held is not None  # _decoded_for_batch() decodes only calls for a held model
        self.mark_running(held.model_id)
        replies = self._predict_alike(held, group)
        self.mark_running(None)
        return replies

    def _predict_alike(self, held: Held, group: list[batching.InferCall]) -> dict[int, list]:
        shares: Sequence[dict | None] = [None] * len(group)  # None: the call predicts on its own
        if len(group) > 1:
            try:
                # Alike calls: the first one's parameters and requested outputs are everyone's.
                outputs = self._predict(group[0], batching.stacked_inputs(group))
                shares = batching.split_outputs(group, outputs)
            except BaseException as error:
                log.info(
                    "a batch of %d calls failed (%s); running them one by one",
                    len(group),
                    protocol.described(error),
                    extra={"model_id": held.model_id},
                )
        return {
            call.request_id: self._answer(
                held, call.request_id, protocol.METHOD_INFER, self._reply_to, call, share
            )
            for call, share in zip(group, shares, strict=True)
        }

    def _reply_to(self, call: batching.InferCall, outputs: dict | None) -> list:
        """The reply to one call: with its share of a batch's outputs, else after its own predict."""
        if outputs is None:
            outputs = self._predict(call, call.inputs)
        return self._infer_reply(call, outputs)


class _Unimplemented(Exception):
    pass
