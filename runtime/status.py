"""Every gRPC status the runtime answers with is decided here.

Code anywhere in runtime/ raises RpcError through one of the constructors
below; the servicers turn it into the call's status with `abort()`. Worker
error kinds (workers/protocol.py) map to codes in WORKER_ERROR_CODES.
Messages are for humans: they name the model and say what went wrong. None
of them reads "Model ... not found" unless the code is NOT_FOUND: model-mesh
treats that text as a missing model (contract doc section 4.3).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal

import grpc

from workers import protocol

log = logging.getLogger("mesh.status")


# A status's message as sent, percent-encoded: grpc writes each byte of UTF-8 outside printable
# ASCII (and "%") as three characters.
DETAILS_MAX_BYTES = 1024


class RpcError(Exception):
    """An error that is a value: a gRPC status code and its message."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message

    def __repr__(self) -> str:
        return f"RpcError({self.code.name}, {self.message!r})"


def model_not_found(model_id: str) -> RpcError:
    return RpcError(grpc.StatusCode.NOT_FOUND, f"model {model_id!r} is not loaded in this runtime")


def invalid_argument(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INVALID_ARGUMENT, message)


def failed_precondition(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.FAILED_PRECONDITION, message)


def load_timed_out(model_id: str, timeout_ms: int, waiting_for: str | None = None) -> RpcError:
    """`waiting_for`: what the load still waited for when its time ran out (it never started)."""
    if waiting_for:
        return RpcError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"load of {model_id!r} did not start within LOADTIME_TIMEOUT={timeout_ms} ms: it was still "
            f"waiting for {waiting_for}",
        )
    return RpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"load of {model_id!r} did not finish within LOADTIME_TIMEOUT={timeout_ms} ms; its worker was killed",
    )


def load_cancelled(model_id: str) -> RpcError:
    return RpcError(grpc.StatusCode.CANCELLED, f"load of {model_id!r} was cancelled; its worker was killed")


def worker_died(model_id: str, during: str, exit_code: int | None, cause: str = "") -> RpcError:
    """A worker vanished mid-operation: loads fail for good, calls may be retried elsewhere.
    `cause` says why where the front knows better than the exit code."""
    what = cause or describe_exit(exit_code)
    if during == "load":
        return failed_precondition(f"the worker loading {model_id!r} died ({what})")
    return RpcError(grpc.StatusCode.UNAVAILABLE, f"the worker serving {model_id!r} died ({what})")


def out_of_workers(limit: int, os_limit: str | None = None) -> RpcError:
    """`os_limit`: the pool's os_limit_reached(), where an OS limit rather than WORKERS_MAX holds."""
    if os_limit == "open-file":
        reason = (
            "the front's open-file limit (RLIMIT_NOFILE) holds no more workers: raise it or lower WORKERS_MAX"
        )
    elif os_limit == "task":
        reason = "the pids cgroup's pids.max holds no more workers: raise it or lower WORKERS_MAX"
    else:
        reason = f"all {limit} worker processes allowed by WORKERS_MAX are in use"
    return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, reason)


def workers_do_not_start(group: str, failures: int) -> RpcError:
    return RpcError(
        grpc.StatusCode.UNAVAILABLE,
        f"{failures} workers of the {group} fork server in a row did not start; the runtime's log says why",
    )


def queue_full(model_id: str, limit: int) -> RpcError:
    return RpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"{limit} requests for {model_id!r} already wait for a free worker (MODEL_QUEUE_MAX)",
    )


def over_byte_budget(model_id: str, size: int, held: int, setting: str, limit: int) -> RpcError:
    whose = f"calls for {model_id!r}" if setting == "MODEL_BYTES_MAX" else "calls"
    return RpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"a {size}-byte request for {model_id!r} does not fit: {whose} already hold {held} "
        f"bytes in the front, and {setting}={limit}",
    )


def responses_over_budget(model_id: str, size: int, sending: int, limit: int) -> RpcError:
    return RpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the {size}-byte response for {model_id!r} cannot be held until sent: responses their "
        f"clients have not read yet hold {sending} bytes, and may hold {limit} (half of FRONT_BYTES_MAX, "
        "or GRPC_MAX_MESSAGE_BYTES if more, leaving GRPC_MAX_MESSAGE_BYTES of it for a read)",
    )


def service_name_too_long(length: int, limit: int) -> RpcError:
    return invalid_argument(f"a health service name of {length} characters: none is over {limit}")


def response_too_large(model_id: str, size: int, limit: int) -> RpcError:
    return RpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the response of {model_id!r} is {size} bytes, over GRPC_MAX_MESSAGE_BYTES={limit}",
    )


def over_memory_limit(model_id: str, reason: str) -> RpcError:
    return RpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the worker serving {model_id!r} was killed, {reason}; the model is reloading",
    )


def request_too_long(model_id: str, limit_ms: int) -> RpcError:
    return RpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"request for {model_id!r} ran past WORKER_REQUEST_TIMEOUT_MS={limit_ms}; "
        f"its worker was killed and the model is reloading",
    )


def deadline_exceeded(model_id: str) -> RpcError:
    return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request for {model_id!r} ran past its deadline")


def read_line_full(waiting: int, budget: str, limit: int) -> RpcError:
    return RpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"{waiting} calls already wait for room in {budget}={limit} to be read",
    )


def deadline_passed_before_reading(budget: str) -> RpcError:
    return RpcError(
        grpc.StatusCode.DEADLINE_EXCEEDED,
        f"the call's deadline passed while it waited for room in {budget} to be read",
    )


def read_gave_way(seconds: float) -> RpcError:
    return RpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"the call's request had not come whole {seconds:g} s after its read began, and other calls "
        "waited for the room that read held",
    )


def streamed_request_too_big(size: int, limit: int) -> RpcError:
    return RpcError(
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"a streamed request message of {size} bytes: this method takes none over {limit}",
    )


def stream_idle(seconds: float) -> RpcError:
    return RpcError(grpc.StatusCode.DEADLINE_EXCEEDED, f"the stream sent no message for {seconds:g} s")


def too_many_streams(limit: int) -> RpcError:
    return RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{limit} calls of this method are open already")


def request_not_sent(seconds: float) -> RpcError:
    return invalid_argument(f"the call's request did not come within {seconds:g} s of its start")


def unavailable(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.UNAVAILABLE, message)


def internal(message: str) -> RpcError:
    return RpcError(grpc.StatusCode.INTERNAL, message)


WORKER_ERROR_CODES = {
    protocol.ERROR_LOAD: grpc.StatusCode.FAILED_PRECONDITION,
    protocol.ERROR_INVALID_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
    protocol.ERROR_MODEL: grpc.StatusCode.INTERNAL,
    protocol.ERROR_UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    protocol.ERROR_NOT_LOADED: grpc.StatusCode.NOT_FOUND,
    protocol.ERROR_EXPIRED: grpc.StatusCode.DEADLINE_EXCEEDED,
    protocol.ERROR_PROTOCOL: grpc.StatusCode.INTERNAL,
}


def from_worker(model_id: str, reply: dict) -> RpcError:
    """The status for a failed worker reply."""
    kind = reply.get("error")
    code = grpc.StatusCode.INTERNAL  # no kind, or one this front does not know
    if isinstance(kind, str):
        code = WORKER_ERROR_CODES.get(kind, code)
    message = str(reply.get("message", "no message"))
    if code is grpc.StatusCode.FAILED_PRECONDITION:
        message = f"model {model_id!r} raised while loading: {message}"
    return RpcError(code, message)


def describe_exit(exit_code: int | None) -> str:
    if exit_code is None:
        return "exit status unknown"
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exit code {exit_code}"


async def abort(context, error: RpcError):
    """Ends the call with the error's status (raises, as grpc.aio's abort does).

    The error's traceback and the exceptions chained to it are dropped first:
    they hold the frames the error passed through, and with them the call's
    request bytes, until the cyclic garbage collector runs, which may be many
    megabytes of refused requests later.
    """
    error.__traceback__ = error.__context__ = error.__cause__ = None
    try:
        await context.abort(error.code, details(error.message))
    except grpc.aio.InternalError as failed:
        # grpc's core ended the call meanwhile (its deadline passed in the same instant), and
        # would log the failed abort as an error of ours, with its traceback; a cancelled call's
        # handler it ends quietly.
        log.debug("the call ended before it could be aborted with %s: %r", error.code.name, failed)
        raise asyncio.CancelledError() from None


def details(message: str) -> str:
    """A status's message as sent: at most DETAILS_MAX_BYTES once percent-encoded. grpc sends it in
    a trailer, and a client refuses trailers past its metadata limit (8 KiB by default), which
    turns the status into RESOURCE_EXHAUSTED; names and model errors come from clients, in any
    script (a CJK character is nine bytes encoded), and what no UTF-8 can hold (a lone
    surrogate) is written as its escape."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    if _encoded_length(message[: DETAILS_MAX_BYTES + 1]) <= DETAILS_MAX_BYTES:
        return message
    room = DETAILS_MAX_BYTES - 48  # for the note of what was cut
    kept = 0
    for char in message[:room]:
        room -= _encoded_length(char)
        if room < 0:
            break
        kept += 1
    return f"{message[:kept]}... ({len(message) - kept} more characters)"


def _encoded_length(text: str) -> int:
    """Characters `text` takes percent-encoded as grpc sends a status's message."""
    encoded = text.encode("utf-8")
    plain = sum(1 for byte in encoded if 0x20 <= byte <= 0x7E and byte != 0x25)
    return plain + 3 * (len(encoded) - plain)


def translated(handler):
    """Decorates an async servicer method: RpcError -> its status; a bug -> INTERNAL, logged."""

    @functools.wraps(handler)
    async def wrapper(self, request, context):
        try:
            return await handler(self, request, context)
        except RpcError as error:
            await abort(context, error)
        except Exception as error:
            if isinstance(error, grpc.aio.AbortError):
                raise
            log.exception("%s failed unexpectedly", handler.__name__)
            await abort(context, internal(f"{handler.__name__} failed: {type(error).__name__}: {error}"))

    return wrapper
