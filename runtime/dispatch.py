"""One inference call, from the data plane to a worker and back.

`Dispatcher.call()` reads top to bottom: find the ready model, count the
request against the byte budget, pick the least busy replica (or wait in the
model's line), send the request bytes, await the reply, map the outcome to a
status, splice the reply's frames into one response. The model's life cycle
(load, heal, unload) is the supervisor's; the worker socket is the pool's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from protos import wire
from runtime import status
from runtime.budget import ByteBudget
from runtime.channel import PeerGone
from runtime.model import Model
from runtime.pool import WorkerPool
from runtime.settings import Settings
from runtime.supervisor import Supervisor
from runtime.worker import KillCause, Worker
from workers import protocol

log = logging.getLogger("mesh.dispatch")

REQUEST_TIMEOUT_REASON = "a request ran past WORKER_REQUEST_TIMEOUT_MS"
# How long a call that found its worker gone waits for the reap, which tells how it died.
REAP_WAIT_SECONDS = 0.5
# How many times a call is sent again when a recycle ends the pack it was queued in.
RESENDS_MAX = 2
# The causes a pack's models' calls not yet begun outlive: their models moved out first (a worker of
# its own is killed for UNLOAD only once its model is unloaded).
_ENDED_AFTER_A_MOVE = (KillCause.RECYCLED, KillCause.UNLOAD)


class _CallLost(Exception):
    """The worker a call went to died before it answered, and the call is not sent again."""

    def __init__(self, worker: Worker, gone: PeerGone):
        super().__init__(str(gone))
        self.worker, self.gone = worker, gone


class Dispatcher:
    def __init__(self, settings: Settings, supervisor: Supervisor, pool: WorkerPool, budget: ByteBudget):
        self.supervisor = supervisor
        self.pool = pool
        self.budget = budget
        self.largest_response = settings.grpc_max_message_bytes
        self.request_limit_ms = settings.worker_request_timeout_ms

    async def call(self, model_id: str, method: str, request: bytes, timeout: float | None) -> bytes:
        """Forwards a request's bytes to one of the model's workers and returns the response bytes."""
        model = self.supervisor.ready_model(model_id)
        model.called = True  # a load sent to its pack after this waits behind the call, not before
        self.budget.reserve(model_id, len(request))
        # The deadline covers time in line too. Here rather than in a coroutine of its own: each
        # one an await goes through costs the event loop as it starts and as the reply comes.
        deadline = None if timeout is None else time.time() + timeout
        try:
            if timeout is None:  # no deadline, no timer
                worker, reply, frames = await self._send_to_a_replica(model, method, request, None)
            else:
                async with asyncio.timeout(timeout):
                    worker, reply, frames = await self._send_to_a_replica(model, method, request, deadline)
        except TimeoutError:
            raise status.deadline_exceeded(model_id) from None
        except _CallLost as lost:  # out of the deadline's timer: the reap's wait keeps within it
            raise await self._status_of_lost_call(model, lost.worker, lost.gone, deadline) from None
        finally:
            self.budget.release(model_id, len(request))
        if not reply["ok"]:
            worker.errors += 1
            worker.last_error = str(reply.get("message", ""))
            raise status.from_worker(model_id, reply)
        worker.served += 1
        return self._response(model_id, frames, reply.get("append_field"))

    async def _send_to_a_replica(
        self, model: Model, method: str, request: bytes, deadline: float | None
    ) -> tuple[Worker, dict, list]:
        """Picks a replica, sends the call and awaits its reply. A call its pack had not begun when
        the pack was ended after its models moved out goes again, to where the model moved: queued
        behind a call that kept the pack from answering (the unload of that call's model recycled
        it; a slow load the pack was left to), it never ran."""
        for sends_left in range(RESENDS_MAX, -1, -1):
            worker = model.replicas.try_acquire() or await model.replicas.acquire()
            try:
                reply, frames = await self._send(model, worker, method, request, deadline)
                return worker, reply, frames
            except PeerGone as gone:
                # A pack ended by a move, or left to a slow load and ended (or crashed) by it: the
                # model is elsewhere.
                elsewhere = worker.kill_cause in _ENDED_AFTER_A_MOVE or model.model_id in worker.moved_out
                moved = elsewhere and not model.unload_requested
                if gone.begun or not moved or not sends_left:
                    raise _CallLost(worker, gone) from None
        raise AssertionError("the last send returns or raises")

    async def _status_of_lost_call(
        self, model: Model, worker: Worker, gone: PeerGone, deadline: float | None
    ) -> status.RpcError:
        """The status of a call whose worker died before it answered."""
        if gone.exit_code is None and not gone.cause and not worker.kill_cause:
            # Found gone before it was reaped (its socket unreachable), not by our kill: its reap
            # says how it died. Not past the call's deadline: mesh may try another instance.
            left = REAP_WAIT_SECONDS if deadline is None else deadline - time.time()
            await worker.reaped_within(min(REAP_WAIT_SECONDS, left))
            gone = PeerGone(worker.exit_code(), worker.death_cause)
        return _death_status(model, worker, gone)

    def _send(
        self, model: Model, worker: Worker, method: str, request: bytes, deadline: float | None
    ) -> asyncio.Future:
        """Sends the call; its replica slot is freed when the worker is done with it.

        A caller that gives up cancels only the future: the call stays counted
        on its worker until the worker answers (a busy worker is not idle),
        and WORKER_REQUEST_TIMEOUT_MS still ends a worker stuck in it.
        """
        if not worker.alive:  # reaped while this call waited its turn: no reply would ever come
            model.replicas.release(worker)
            raise PeerGone(worker.exit_code(), worker.death_cause)
        limit_ms = self.request_limit_ms
        # Partials rather than lambdas: the channel calls on_end for every call, and a partial goes
        # straight to the method, one Python frame fewer; on_overdue is made only when it may run.
        return self.pool.submit_call(
            worker,
            model.model_id,
            method,
            request,
            deadline,
            model.replicas.unanswered_per_replica(),
            on_end=functools.partial(model.replicas.release, worker),
            overdue_after=limit_ms / 1000 if limit_ms else None,
            on_overdue=functools.partial(self._overdue, model.model_id, worker) if limit_ms else None,
        )

    def _overdue(self, model_id: str, worker: Worker) -> status.RpcError:
        """WORKER_REQUEST_TIMEOUT_MS passed, whether or not the caller still waits: end the worker."""
        limit_ms = self.request_limit_ms
        self.pool.kill(worker, KillCause.REQUEST_TIMEOUT, f"{REQUEST_TIMEOUT_REASON} ({limit_ms} ms)")
        return status.request_too_long(model_id, limit_ms)

    def _response(self, model_id: str, frames: list, append_field: int | None) -> bytes:
        # Judged on the frames first: joining a response far over the limit would copy it on the loop.
        self._refuse_over_limit(model_id, sum(map(len, frames)))
        response = spliced(frames, append_field)
        if len(frames) > 1:
            self._refuse_over_limit(model_id, len(response))  # with the few bytes splicing adds
        return response

    def _refuse_over_limit(self, model_id: str, size: int) -> None:
        if size > self.largest_response:  # grpc would fail it with a traceback
            error = status.response_too_large(model_id, size, self.largest_response)
            log.warning("%s", error.message, extra={"model_id": model_id})
            raise error


def _death_status(model: Model, worker: Worker | None, gone: PeerGone) -> status.RpcError:
    if model.unload_requested:  # the documented race: a request just as mesh unloads
        return status.model_not_found(model.model_id)
    if worker is not None and worker.kill_cause is KillCause.MEMORY:
        return status.over_memory_limit(model.model_id, worker.kill_reason)
    return status.worker_died(model.model_id, "call", gone.exit_code, gone.cause)


def spliced(frames: list, append_field: int | None) -> bytes:
    """The response: the first frame, plus each further frame appended as field `append_field`.

    The frames are still ZeroMQ's buffers: this is the one copy the front makes.
    """
    if len(frames) == 1:
        return bytes(frames[0])
    if append_field is None:  # the worker's reply header names it whenever it sends extra frames
        raise protocol.ProtocolError(f"a reply of {len(frames)} frames names no append_field")
    parts = [frames[0]]
    for extra in frames[1:]:
        parts.append(wire.bytes_field_header(append_field, len(extra)))
        parts.append(extra)
    return b"".join(parts)
