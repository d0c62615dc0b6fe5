"""Where a model's next request goes: the least busy replica, or a bounded line.

A model has up to MODEL_REPLICAS ready workers, each running up to
WORKER_THREADS calls at once and holding PIPELINE_DEPTH more in its socket
queue, so that it starts the next call the moment it finishes one instead of
idling through a round trip to the front (scripts/bench: about twice the
throughput at 16 clients). A worker drops a queued call whose deadline
passed. `acquire()` picks the ready replica with the fewest calls in flight;
when none has room (all busy, or all being healed)
the caller waits in line, and when MODEL_QUEUE_MAX callers already wait it
is refused with RESOURCE_EXHAUSTED (model-mesh retries elsewhere). Whenever
room appears (a call ends, a healed replica joins) the line is served in
order. `fail_line()` ends every wait when the model goes away.

Room is counted per model (`Worker.calls`): a pack (runtime/packs.py) serves
several models, and each may hold its slots in it, so one model's burst does
not lock its neighbours out of the pack (their calls queue in the pack's
socket instead). The worker's own `in_flight` counts every model's calls.
"""

from __future__ import annotations

import asyncio
import collections
import math

from runtime import status
from runtime.worker import Worker

# Calls a worker may hold beyond those it runs. Small: a call queued behind a
# slow one cannot move to another replica.
PIPELINE_DEPTH = 2


def slots_per_worker(threads: int, batch_max: int, batches_rows: bool) -> int:
    """Calls one worker may hold: those it runs plus PIPELINE_DEPTH, or a batch's worth.

    A single-threaded worker of a row-wise model predicts the calls queued
    in its socket together (workers/batching.py), up to batch_max at once,
    so it holds one batch waiting behind the one it runs.
    """
    if batches_rows and threads == 1 and batch_max > 1:
        return 1 + max(PIPELINE_DEPTH, batch_max)
    return threads + PIPELINE_DEPTH


class ReplicaSet:
    def __init__(self, model_id: str, slots: int, queue_max: int):
        self.model_id = model_id
        self.slots = slots
        self.queue_max = queue_max
        self.workers: list[Worker] = []  # ready to serve
        self.unanswered = 0  # calls counted in on any worker, ready or not, and not yet released
        self._line: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._line)

    def add(self, worker: Worker) -> None:
        self.workers.append(worker)
        self._serve_line()

    def remove(self, worker: Worker) -> None:
        if worker in self.workers:
            self.workers.remove(worker)

    def _least_busy(self) -> Worker | None:
        best, fewest = None, self.slots
        for worker in self.workers:
            calls = worker.calls.get(self.model_id, 0)
            if calls < fewest and worker.serving:
                best, fewest = worker, calls
        return best

    def _count_in(self, worker: Worker) -> None:
        self.unanswered += 1
        worker.in_flight += 1
        worker.calls[self.model_id] = worker.calls.get(self.model_id, 0) + 1

    def try_acquire(self) -> Worker | None:
        """A replica with room, counted in, when nobody waits in line; else None."""
        if self._line:
            return None
        worker = self._least_busy()
        if worker is not None:
            self._count_in(worker)
        return worker

    async def acquire(self) -> Worker:
        worker = self.try_acquire()
        if worker is not None:
            return worker
        if len(self._line) >= self.queue_max:
            raise status.queue_full(self.model_id, self.queue_max)
        turn = asyncio.get_running_loop().create_future()
        self._line.append(turn)
        try:
            return await turn  # _serve_line counted the call in for us
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self.release(turn.result())  # handed a replica as we gave up: pass it on
            elif turn in self._line:
                self._line.remove(turn)
            raise

    def unanswered_per_replica(self) -> int:
        """The model's calls sent and not answered yet, or waiting in line, per ready replica.

        Each call carries it: a row-wise worker holding fewer learns that the
        front is still busy with the model's other calls, whose clients send
        their next ones right after their answers (workers/batching.py).
        """
        unanswered = self.unanswered + len(self._line)
        if len(self.workers) < 2:  # the common case, without counting
            return unanswered
        serving = sum(1 for worker in self.workers if worker.serving)
        return math.ceil(unanswered / serving) if serving else unanswered

    def release(self, worker: Worker) -> None:
        self.unanswered -= 1
        worker.in_flight -= 1
        left = worker.calls[self.model_id] - 1
        if left:
            worker.calls[self.model_id] = left
        else:
            del worker.calls[self.model_id]
        if self._line:  # nobody waits unless every replica is full: no call for every release
            self._serve_line()

    def _serve_line(self) -> None:
        while self._line:
            worker = self._least_busy()
            if worker is None:
                return
            turn = self._line.popleft()
            if not turn.done():
                self._count_in(worker)
                turn.set_result(worker)

    def fail_line(self, error: Exception) -> None:
        while self._line:
            turn = self._line.popleft()
            if not turn.done():
                turn.set_exception(error)
