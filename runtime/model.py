"""A model in the front's table: its spec, state, workers, line of calls, and crash record.

    LOADING ──loaded──► READY ──unloadModel, purge, dropped──► UNLOADING ──reaped──► (gone)
       └──── load failed, timed out or cancelled ──────────────────┘

`change_state()` refuses any other move. The supervisor makes every move
(runtime/supervisor.py).
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time

from runtime.modelspec import ModelSpec
from runtime.replicas import ReplicaSet, slots_per_worker
from runtime.settings import Settings
from runtime.worker import IllegalTransition, Worker


class ModelState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"


_MOVES = {
    ModelState.LOADING: {ModelState.READY, ModelState.UNLOADING},
    ModelState.READY: {ModelState.UNLOADING},
    ModelState.UNLOADING: set(),
}


class Model:
    def __init__(self, spec: ModelSpec, settings: Settings):
        self.spec = spec
        self.model_id = spec.model_id
        self.state = ModelState.LOADING
        self.workers: list[Worker] = []  # every worker this model owns, loading ones included
        slots = slots_per_worker(settings.worker_threads, settings.worker_batch_max, spec.format.batches_rows)
        self.replicas = ReplicaSet(spec.model_id, slots, settings.model_queue_max)
        self.size = 0
        self.packed = False  # it lives in packs (runtime/packs.py), not in workers of its own
        self.called = False  # a call has been sent to one of its workers
        # Its latest load into a pack ran past runtime/slowloads.py's SLOW_LOAD_SECONDS: where it
        # can be helped, it is not loaded again beside serving models, whose calls would wait as long.
        self.loads_slowly = False
        self.load_started = time.monotonic()
        self.load_task: asyncio.Task[int] | None = None  # resolves to the measured size
        self.heal_task: asyncio.Task | None = None
        self.crashes: collections.deque[float] = collections.deque()
        self.unload_requested = False  # by unloadModel or a purge, as opposed to a crash
        self.was_ready = False  # its load succeeded: its end is an unload (a failed load's is not)
        self.gone = asyncio.get_running_loop().create_future()  # resolves once nothing is left

    def change_state(self, new: ModelState) -> None:
        if new not in _MOVES[self.state]:
            raise IllegalTransition(
                f"model {self.model_id!r}: {self.state.value} -> {new.value} is not a move a model makes"
            )
        self.state = new
        self.was_ready = self.was_ready or new is ModelState.READY

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY

    def end_told(self) -> str:
        """Its end, as the log tells it: as for mesh_unloads_total, a failed load is no unload."""
        return f"{self.model_id} unloaded" if self.was_ready else f"{self.model_id} gone, its load unfinished"
