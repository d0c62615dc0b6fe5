"""Every unary call's request is read under the front's byte budget.

grpc reads a unary call's request whole before its handler runs, for every
call it has accepted: sixty concurrent 30 MiB requests were 1.8 GB in the
front before any handler could refuse one. A stream-unary handler's request
is read only when the handler asks, and until then HTTP/2 flow control keeps
all but a window of it in the client (runtime/server.py sets the window). So
every unary method is served as stream-unary: the handler first waits for
room in the budget (runtime/budget.py), then reads the one request. Clients
see an ordinary unary method.

A read the budget gives up on (a silent stream: too long under way while
other calls wait for its room, or past the control methods' limit) is ended
by aborting its call from a task of its own, not by cancelling the handler:
grpc frees a received request only as its receive returns to the handler,
so a cancel landing in the turn the request came whole would leak it. Once
the status is sent, the handler's read raises grpc's AbortError, which ends
the handler quietly.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from runtime import status
from runtime.budget import ByteBudget, Read

log = logging.getLogger("mesh.reading")

# A control call's request (model-mesh's management API, health, the V2 server and model checks)
# that has not come this long after its read began is refused: streams opened and left silent
# would hold the control methods' budget for as long as they stay open. Those requests are tiny.
CONTROL_READ_SECONDS = 5.0
# Each message of a method that streams requests: reflection's name a symbol or a file, and are
# echoed back in its answers, which grpc holds, outside any budget, until the client reads them.
STREAMED_REQUEST_MAX = 65536
# Calls of such a method at once: grpc reads each message whole (up to GRPC_MAX_MESSAGE_BYTES)
# before it can be refused. One whose client sends nothing for STREAM_IDLE_SECONDS is ended, so
# that clients that leave theirs open do not keep every other one out.
STREAMING_CALLS_MAX = 4
STREAM_IDLE_SECONDS = 30.0

_ending: set[asyncio.Task] = set()  # the aborts under way, kept from the garbage collector


# ended(error, *about): told as the budget ends a read, before its call is aborted with `error`
# (the data plane counts the call in its metrics, which it cannot once grpc has ended the handler).
Ended = Callable[..., None]
# What owns a read in the budget: (the call's context, ended or None, about). A plain tuple: one
# is made for every call.
Caller = tuple[Any, Ended | None, tuple]


async def read_request(budget: ByteBudget, context, ended: Ended | None = None, about: tuple = ()) -> bytes:
    """The call's request bytes, read once the budget has room for the largest allowed request.

    One coroutine, not two: every call runs it, and each coroutine an await goes through costs
    the front's event loop when it starts and again when the request comes (callgrind)."""
    caller = (context, ended, about)
    read = budget.try_start_reading(caller)
    if read is None:
        read = await _wait_to_read(budget, caller)
    try:
        request = await context.read()  # grpc's AbortError once end_read() has ended the call
    finally:
        budget.done_reading(read)
    if request is grpc.aio.EOF:
        raise status.invalid_argument("the call carried no request message")
    return request


async def _wait_to_read(budget: ByteBudget, caller: Caller) -> Read:
    try:
        async with asyncio.timeout(caller[0].time_remaining()):
            return await budget.start_reading(caller)
    except TimeoutError:
        raise status.deadline_passed_before_reading(budget.name) from None


def end_read(caller: Caller, still_reading: Callable[[], bool], seconds: float, past_limit: bool) -> None:
    """ByteBudget's end_read: ends the call whose read lasted `seconds` too long (see above)."""
    error = status.request_not_sent(seconds) if past_limit else status.read_gave_way(seconds)
    task = asyncio.get_running_loop().create_task(_abort_while_reading(caller, still_reading, error))
    _ending.add(task)
    task.add_done_callback(_ended)


async def _abort_while_reading(
    caller: Caller, still_reading: Callable[[], bool], error: status.RpcError
) -> None:
    if not still_reading():
        return  # its request came meanwhile: the call goes on
    context, ended, about = caller
    log.warning("refused a call from %s: %s", context.peer(), error.message)
    if ended is not None:
        ended(error, *about)  # first: abort() sends the status, and the client may then read the metrics
    await status.abort(context, error)


def _ended(task: asyncio.Task) -> None:
    _ending.discard(task)
    error = None if task.cancelled() else task.exception()
    if error is None or isinstance(error, grpc.aio.AbortError):
        return  # not needed (its request came), or done: abort() raises once the status is sent
    if isinstance(error, grpc.aio.InternalError):  # the call ended meanwhile (client gone, deadline)
        log.debug("a call whose read lasted too long ended before its abort: %r", error)
    else:
        log.error("ending a call whose read lasted too long failed: %r", error)


def budgeted(handler: grpc.RpcMethodHandler, budget: ByteBudget) -> grpc.RpcMethodHandler:
    """The same method with one request, served as one that streams requests, so that its request
    is read under `budget`: unary-unary as stream-unary, unary-stream (health's Watch) as
    stream-stream.

    Methods that stream requests (reflection's) are bounded otherwise
    (_streaming_under).
    """
    if handler is None:
        return handler
    if handler.request_streaming:
        return _streaming_under(handler)
    deserialize, serializer = handler.request_deserializer, handler.response_serializer
    if handler.response_streaming:
        answer_stream = handler.unary_stream

        async def serve_stream(request_iterator, context):
            answers = answer_stream(await _budgeted_request(budget, context, deserialize), context)
            if inspect.isasyncgen(answers):
                async for answer in answers:
                    await context.write(answer)
            else:  # a coroutine that writes its answers itself
                await answers

        return grpc.stream_stream_rpc_method_handler(serve_stream, response_serializer=serializer)
    behaviour = handler.unary_unary

    async def serve(request_iterator, context):
        answer = behaviour(await _budgeted_request(budget, context, deserialize), context)
        return await answer if inspect.isawaitable(answer) else answer

    return grpc.stream_unary_rpc_method_handler(serve, response_serializer=serializer)


def _streaming_under(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A method that streams requests (reflection's), with at most STREAMING_CALLS_MAX of its calls
    at once and each message at most STREAMED_REQUEST_MAX. Not under the control methods' budget:
    a stream waits for its client's next message for as long as that client likes, and would hold
    one of that budget's reads meanwhile (and be ended CONTROL_READ_SECONDS on)."""
    deserialize, serializer = handler.request_deserializer, handler.response_serializer
    behaviour = handler.stream_stream if handler.response_streaming else handler.stream_unary
    open_calls = 0

    async def serve(request_iterator, context):
        nonlocal open_calls
        if open_calls >= STREAMING_CALLS_MAX:
            await status.abort(context, status.too_many_streams(STREAMING_CALLS_MAX))
        open_calls += 1
        try:
            answers = behaviour(_capped_requests(context, deserialize), context)
            if not handler.response_streaming:
                return await answers
            if inspect.isasyncgen(answers):
                async for answer in answers:
                    await context.write(answer)
            else:  # a coroutine that writes its answers itself
                await answers
        finally:
            open_calls -= 1

    if handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(serve, response_serializer=serializer)
    return grpc.stream_unary_rpc_method_handler(serve, response_serializer=serializer)


async def _capped_requests(context, deserialize) -> AsyncIterator[Any]:
    """The call's request messages; the call is aborted at one over STREAMED_REQUEST_MAX, or once
    its client has sent none for STREAM_IDLE_SECONDS (it holds one of STREAMING_CALLS_MAX)."""
    while True:
        try:
            async with asyncio.timeout(STREAM_IDLE_SECONDS):
                message = await context.read()
        except TimeoutError:
            await status.abort(context, status.stream_idle(STREAM_IDLE_SECONDS))
        if message is grpc.aio.EOF:
            return
        try:
            if len(message) > STREAMED_REQUEST_MAX:
                raise status.streamed_request_too_big(len(message), STREAMED_REQUEST_MAX)
            request = message if deserialize is None else _deserialized(deserialize, message)
        except status.RpcError as error:
            del message  # the abort's traceback holds this frame: not the message with it
            await status.abort(context, error)
        yield request


async def _budgeted_request(budget: ByteBudget, context, deserialize):
    """The call's request, read under `budget` and deserialised; the call is aborted when it cannot be."""
    request = None
    try:
        request = await read_request(budget, context)
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
