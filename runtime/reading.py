"""Every unary call's request is read under the front's byte budget.

grpc reads a unary call's request whole before its handler runs, for every
call it has accepted: sixty concurrent 30 MiB requests were 1.8 GB in the
front before any handler could refuse one. A stream-unary handler's request
is read only when the handler asks, and until then HTTP/2 flow control keeps
all but a window of it in the client (runtime/server.py sets the window). So
every unary method is served as stream-unary: the handler first waits for
room in the budget (runtime/budget.py), then reads the one request. Clients
see an ordinary unary method.
"""

from __future__ import annotations

import asyncio
import inspect
import logging

import grpc

from runtime import status
from runtime.budget import SLOW_READ_SECONDS, ByteBudget, Read

log = logging.getLogger("mesh.reading")

# A control call's request (model-mesh's management API, health, the V2 server and model checks)
# that has not come this long after the call began is refused: streams opened and left silent
# would hold the control methods' budget for as long as they stay open. Those requests are tiny.
CONTROL_READ_SECONDS = 5.0


async def read_request(budget: ByteBudget, context, within: float | None = None) -> bytes:
    """The call's request bytes, read once the budget has room for the largest allowed request;
    INVALID_ARGUMENT if they do not come `within` seconds (None: as long as the call lasts), and
    RESOURCE_EXHAUSTED if the read turned slow while other calls waited for its room."""
    read = budget.try_start_reading()
    if read is None:
        read = await _wait_to_read(budget, context.time_remaining())
    try:
        if within is None:  # the calls' path: no timer
            request = await context.read()
        else:
            async with asyncio.timeout(within):
                request = await context.read()
    except TimeoutError:
        raise status.request_not_sent(within or 0) from None
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or not budget.gave_way(read):
            raise
        task.uncancel()  # the budget cancelled it, to end this read: the call goes on, to its refusal
        error = status.read_gave_way(SLOW_READ_SECONDS)
        log.warning("refused a call from %s: %s", context.peer(), error.message)
        raise error from None
    finally:
        budget.done_reading(read)
    if request is grpc.aio.EOF:
        raise status.invalid_argument("the call carried no request message")
    return request


async def _wait_to_read(budget: ByteBudget, seconds_left: float | None) -> Read:
    try:
        async with asyncio.timeout(seconds_left):
            return await budget.start_reading()
    except TimeoutError:
        raise status.deadline_passed_before_reading() from None


def budgeted(
    handler: grpc.RpcMethodHandler, budget: ByteBudget, within: float | None = None
) -> grpc.RpcMethodHandler:
    """The same method with one request, served as one that streams requests, so that its request
    is read under `budget`: unary-unary as stream-unary, unary-stream (health's Watch) as
    stream-stream.

    Methods that stream requests are returned as they are: their requests are
    read one message at a time, when the servicer asks. `within`: see read_request().
    """
    if handler is None or handler.request_streaming:
        return handler
    deserialize, serializer = handler.request_deserializer, handler.response_serializer
    if handler.response_streaming:
        answer_stream = handler.unary_stream

        async def serve_stream(request_iterator, context):
            answers = answer_stream(await _budgeted_request(budget, context, deserialize, within), context)
            if inspect.isasyncgen(answers):
                async for answer in answers:
                    await context.write(answer)
            else:  # a coroutine that writes its answers itself
                await answers

        return grpc.stream_stream_rpc_method_handler(serve_stream, response_serializer=serializer)
    behaviour = handler.unary_unary

    async def serve(request_iterator, context):
        answer = behaviour(await _budgeted_request(budget, context, deserialize, within), context)
        return await answer if inspect.isawaitable(answer) else answer

    return grpc.stream_unary_rpc_method_handler(serve, response_serializer=serializer)


async def _budgeted_request(budget: ByteBudget, context, deserialize, within: float | None):
    """The call's request, read under `budget` and deserialised; the call is aborted when it cannot be."""
    request = None
    try:
        request = await read_request(budget, context, within)
        return request if deserialize is None else _deserialized(deserialize, request)
    except status.RpcError as error:
        del request  # the abort's traceback holds this frame: not the request with it
        await status.abort(context, error)
        raise  # abort() raises; this line is for the type checker


def _deserialized(deserialize, request: bytes):
    try:
        return deserialize(request)
    except Exception as error:  # protobuf's DecodeError, or a deserializer's own
        raise status.invalid_argument(f"the request is not a valid message: {error}") from None
