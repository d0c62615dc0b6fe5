"""Stand-ins for the pool and its workers, so that packs run in-process with no process behind them
(tests/test_repacking.py, tests/test_slow_loads.py): the order of the steps is the test's to set."""

from __future__ import annotations

import asyncio
import collections
import types

from runtime import status
from runtime.model import ModelState
from runtime.pack import Pack
from runtime.replicas import ReplicaSet
from runtime.worker import WorkerState

# The stand-in workers by identity, the latest of each name (a test names its own).
_latest_by_identity: dict[bytes, StandInWorker] = {}


class StandInWorker:
    def __init__(self, name: str, state: WorkerState = WorkerState.SERVING):
        self.name, self.pid, self.packed = name, 4000 + len(name), True
        self.identity = name.encode()
        _latest_by_identity[self.identity] = self
        self.state = state
        self.models: set[str] = set()
        self.held: set[str] = set()  # what the process would hold
        self.in_flight = 0
        self.calls: dict[str, int] = {}
        self.moved_out: set[str] = set()
        self.running: frozenset[str] = frozenset()
        self.kill_cause = None
        self.exited = asyncio.get_running_loop().create_future()
        self.load_seconds = 0.01
        self.refuses_loads = False
        self.refused: set[str] = set()  # ids of models whose loads it refuses

    alive = property(lambda self: self.state is not WorkerState.EXITED)
    serving = property(lambda self: self.state is WorkerState.SERVING)


class StandInChannel:
    """Takes every call a stand-in worker has under way for one it has begun."""

    def ahead_of_next(self, peer: bytes) -> list[int]:
        return []

    def still_pending(self, request_ids: list[int]) -> list[int]:
        return []

    def owes_begun(self, peer: bytes, models) -> bool:
        worker = _latest_by_identity[peer]
        return any(worker.calls.get(model_id) for model_id in models)


class StandInPool:
    """Loads and drops as a pack would: a second load of a model it holds is refused."""

    def __init__(self, *spares: StandInWorker):
        self.channel = StandInChannel()
        self.killed: list[StandInWorker] = []
        self.loading: list[str] = []  # each load sent, in order
        self.to_take = list(spares)
        self.cap_reached = False  # at WORKERS_MAX: no other worker may start
        self.takes = 0
        self.after_load = None  # a test's step, called with (worker, model id) as a load replies

    def spares(self):
        return []

    def replenish(self):
        pass

    def at_cap(self):
        return self.cap_reached

    async def take(self, format_name):
        self.takes += 1
        await asyncio.sleep(0.01)  # a fork
        if not self.to_take:  # as at WORKERS_MAX
            raise status.out_of_workers(len(self.killed) + 1)
        return self.to_take.pop(0)

    async def send_load(self, worker, model_id, format_name, path, pack=False):
        self.loading.append(model_id)
        await asyncio.sleep(worker.load_seconds)
        worker.models.add(model_id)
        if worker.state is WorkerState.SPARE:
            worker.state = WorkerState.SERVING
        if model_id in worker.held or worker.refuses_loads or model_id in worker.refused:
            reply = {"ok": False, "message": f"{model_id} is loaded already, or refused"}
        else:
            worker.held.add(model_id)
            reply = {"ok": True}
        if self.after_load is not None:
            self.after_load(worker, model_id)
        return reply

    async def send_drop(self, worker, model_id):
        worker.models.discard(model_id)
        worker.held.discard(model_id)
        return {"ok": True}

    def kill(self, worker, cause, reason, grace=0.0):
        if worker.alive:
            self.killed.append(worker)
            worker.kill_cause = cause
            worker.state = WorkerState.EXITED
            worker.exited.set_result(-9)


def ready_model(model_id: str):
    fmt = types.SimpleNamespace(name="python", loads_on_any_thread=False, first_calls_bytes=0)
    spec = types.SimpleNamespace(format=fmt, path=f"/m/{model_id}")
    return types.SimpleNamespace(
        model_id=model_id,
        spec=spec,
        workers=[],
        replicas=ReplicaSet(model_id, 3, 10),
        state=ModelState.READY,
        ready=True,
        called=True,
        loads_slowly=False,
        packed=True,
        crashes=collections.deque(),
    )


def holding(pack: Pack, *models) -> None:
    for model in models:
        pack.members[model.model_id] = model
        pack.charged[model.model_id], pack.growth_charged[model.model_id] = 100, 50
        pack.grown[model.model_id] = 50
        pack.worker.held.add(model.model_id)
        model.workers.append(pack.worker)
        model.replicas.add(pack.worker)


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)
