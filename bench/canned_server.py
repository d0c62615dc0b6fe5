"""A bare grpc.aio server that answers ModelInfer with fixed bytes: the ceiling of a Python front.

Case (a) of the data-plane benchmark (bench/plan.py). One generic
handler with no deserialiser and no serialiser: grpc hands it the request
bytes, it returns a serialised ModelInferResponse prepared at start, and
never looks at the request. Whatever mesh-runtime does on top of this (find
the model id, hop to a worker over ZeroMQ, run the model, hop back) is its
cost; this is what grpc.aio alone costs on the same machine.

With --hop it is case (a2), the ceiling of a front that forwards: the
handler sends the request bytes over ZeroMQ (ROUTER, ipc://) to a child
process that answers the fixed bytes at once, and returns what comes back.
That is the bare shape of mesh-runtime's hop, without anything mesh-runtime
does around it (routing, replicas, deadlines, metrics, V2 decode and encode
in the worker).

usage: .venv/bin/python -m bench.canned_server [--port N] [--hop] [--uvloop]
                                              [--response FILE | --elements N [--raw]]

  --response FILE   answer with FILE's bytes (a serialised ModelInferResponse)
  --elements N      else build an FP32 [1, N] response (default 4, typed
                    contents; --raw puts it in raw_output_contents)
  --hop             answer through a child process over ZeroMQ
  --uvloop          run on uvloop's event loop (mesh-runtime's front does by default)

Prints "ready <port>" on stdout once it listens; stops on SIGTERM or SIGINT.
The server options match the runtime's (64 MiB message limits).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing
import os
import signal
import sys

import grpc
import zmq

from plumbing import lifeline, priority
from workers import protocol

METHOD = "/inference.GRPCInferenceService/ModelInfer"
MESSAGE_LIMIT = 64 * 1024 * 1024


def fp32_response(elements: int, raw: bool, model_name: str = "echo") -> bytes:
    """What the echo model answers to an FP32 [1, elements] input named x."""
    import numpy as np

    from protos import grpc_predict_v2_pb2 as pb

    values = np.arange(elements, dtype=np.float32)
    response = pb.ModelInferResponse(model_name=model_name)
    out = response.outputs.add(name="x", datatype="FP32", shape=[1, elements])
    if raw:
        response.raw_output_contents.append(values.tobytes())
    else:
        out.contents.fp32_contents.extend(values.tolist())
    return response.SerializeToString()


class Canned(grpc.GenericRpcHandler):
    def __init__(self, answer: bytes):
        async def model_infer(request: bytes, context) -> bytes:
            return answer

        self._handler = grpc.unary_unary_rpc_method_handler(model_infer)

    def service(self, handler_call_details):
        return self._handler if handler_call_details.method == METHOD else None


class Hop(grpc.GenericRpcHandler):
    """Each call's bytes go to a child process over ZeroMQ; its answer is the response."""

    def __init__(self, answer: bytes):
        address = f"ipc://@canned-hop-{os.getpid()}"  # abstract: no file to leave behind
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.bind(address)
        self._child = multiprocessing.get_context("fork").Process(
            target=_hop_child, args=(address, answer, os.getpid()), daemon=True
        )
        self._child.start()
        self._socket.recv_multipart()  # its hello: it is connected
        self._ids = itertools.count()
        self._waiting: dict[bytes, asyncio.Future] = {}
        self._handler = grpc.unary_unary_rpc_method_handler(self._forward)

    def start(self) -> None:
        asyncio.get_running_loop().add_reader(self._socket.getsockopt(zmq.FD), self._drain)

    def stop(self) -> None:
        self._child.kill()
        self._child.join()

    def service(self, handler_call_details):
        return self._handler if handler_call_details.method == METHOD else None

    async def _forward(self, request: bytes, context) -> bytes:
        call_id = next(self._ids).to_bytes(8, "little")
        answered = self._waiting[call_id] = asyncio.get_running_loop().create_future()
        # mesh-runtime's own frame I/O (workers/protocol.py), so the hop costs what its hop does.
        protocol.send_frames(self._socket, [b"child", call_id, request], protocol.NOBLOCK)
        self._drain()  # the send may have swallowed the descriptor's edge
        return await answered

    def _drain(self) -> None:
        while protocol.readable(self._socket):
            _, call_id, answer = protocol.receive_frames(self._socket, copied=3)
            answered = self._waiting.pop(call_id)
            if not answered.done():  # done: grpc cancelled the call (its client went away)
                answered.set_result(answer)


def _hop_child(address: str, answer: bytes, parent: int) -> None:
    lifeline.die_with_parent(parent)
    priority.schedule_as_batch_work()  # as mesh-runtime's workers are (WORKER_SCHED_BATCH)
    socket = zmq.Context().socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, b"child")
    socket.connect(address)
    socket.send(b"hello")
    while True:
        call_id, _ = socket.recv_multipart()
        socket.send_multipart([call_id, answer])


async def serve(port: int, answer: bytes, hop: bool = False) -> None:
    handler = Hop(answer) if hop else Canned(answer)  # forks: before grpc starts its threads
    if hop:
        handler.start()
    # (a2) schedules grpc's threads as mesh-runtime does (GRPC_THREADS_SCHED_BATCH); (a) stays bare.
    with priority.threads_started_here_run_as_batch_work() if hop else contextlib.nullcontext():
        server = grpc.aio.server(
            options=[
                ("grpc.max_send_message_length", MESSAGE_LIMIT),
                ("grpc.max_receive_message_length", MESSAGE_LIMIT),
                ("grpc.so_reuseport", 0),
            ]
        )
        server.add_generic_rpc_handlers([handler])
        bound = server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
    print(f"ready {bound}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await server.stop(1)
    if hop:
        handler.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (0: any free one)")
    parser.add_argument("--response", metavar="FILE", help="serialised ModelInferResponse to answer with")
    parser.add_argument("--elements", type=int, default=4, help="FP32 [1, N] response when no --response")
    parser.add_argument("--raw", action="store_true", help="put the built response in raw_output_contents")
    parser.add_argument("--hop", action="store_true", help="answer through a child process over ZeroMQ")
    parser.add_argument(
        "--uvloop", action="store_true", help="run on uvloop's event loop, as mesh-runtime's front does"
    )
    args = parser.parse_args()
    if args.response:
        with open(args.response, "rb") as f:
            answer = f.read()
    else:
        answer = fp32_response(args.elements, args.raw)
    loop_factory = None
    if args.uvloop:
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(serve(args.port, answer, args.hop))
    return 0


if __name__ == "__main__":
    sys.exit(main())
