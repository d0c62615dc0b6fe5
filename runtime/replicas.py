"""Where a model's next request goes: the least busy replica, or a bounded queue.

A model has MODEL_REPLICAS workers, each running up to WORKER_THREADS calls
at once. `acquire()` picks the replica with the fewest calls in flight; when
every replica is full the caller waits in line, and when MODEL_QUEUE_MAX
callers already wait it is refused with RESOURCE_EXHAUSTED (model-mesh
retries elsewhere). `release()` hands the freed replica straight to the
first in line, so the line is served in order.
"""
from __future__ import annotations

import asyncio
import collections

from runtime import status
from runtime.pool import Worker


class ReplicaSet:
    def __init__(self, model_id: str, workers: list[Worker], threads: int, queue_max: int):
        self.model_id = model_id
        self.workers = workers
        self.threads = threads
        self.queue_max = queue_max
        self._line: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._line)

    def _least_busy(self) -> Worker | None:
        free = [w for w in self.workers if w.alive and w.in_flight < self.threads]
        return min(free, key=lambda w: w.in_flight, default=None)

    async def acquire(self) -> Worker:
        worker = self._least_busy()
        if worker is not None and not self._line:
            worker.in_flight += 1
            return worker
        if len(self._line) >= self.queue_max:
            raise status.queue_full(self.model_id, self.queue_max)
        turn = asyncio.get_running_loop().create_future()
        self._line.append(turn)
        try:
            return await turn  # release() counted the call in for us
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.release(turn.result())  # handed a replica as we gave up: pass it on
            else:
                self._line.remove(turn)
            raise

    def release(self, worker: Worker) -> None:
        while self._line:
            turn = self._line.popleft()
            if not turn.done():
                if worker.alive:
                    turn.set_result(worker)
                    return
                turn.set_exception(status.unavailable(f"the worker serving {self.model_id!r} died"))
        worker.in_flight -= 1
