"""The model table and each model's life: load, serve, unload, purge.

A model moves LOADING -> READY -> UNLOADING -> (gone), or LOADING -> UNLOADING
when its load fails, times out or is cancelled. Leaving the table always goes
through `_discard()`: it kills the model's worker and removes the model only
once the worker is reaped, and `Model.gone` resolves then. So an unloadModel
that awaits `gone` returns with the memory back in the OS, and nothing that
finishes later can bring the model back: the worker that would have done it
is dead and the table entry belongs to nobody.
"""
from __future__ import annotations

import asyncio
import enum
import functools
import logging
import signal
import time

from protos import wire
from runtime import memory, status
from runtime.channel import PeerGone
from runtime.modelspec import ModelSpec
from runtime.pool import Worker, WorkerPool
from runtime.replicas import ReplicaSet
from runtime.settings import Settings
from workers import protocol

log = logging.getLogger("mesh.supervisor")

# How long a worker may take to run its model's close() on unload before SIGKILL.
UNLOAD_GRACE_SECONDS = 2.0


class State(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"


class Model:
    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.model_id = spec.model_id
        self.state = State.LOADING
        self.workers: list[Worker] = []
        self.replicas: ReplicaSet | None = None  # set once READY
        self.size = 0
        self.load_started = time.monotonic()
        self.load_task: asyncio.Task | None = None
        self.unload_requested = False  # by unloadModel or a purge, as opposed to a crash
        self.gone = asyncio.get_running_loop().create_future()  # resolves once nothing is left


class Supervisor:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.pool = WorkerPool(settings, self._on_worker_exit)
        self._models: dict[str, Model] = {}
        self._load_slots = asyncio.Semaphore(settings.max_loading_concurrency)

    @property
    def ready(self) -> bool:
        return self.pool.ready

    async def start(self) -> None:
        await self.pool.start()

    async def close(self) -> None:
        for model in list(self._models.values()):
            self._discard(model)
        await self.pool.close()

    # -- management ---------------------------------------------------------------

    async def load(self, spec: ModelSpec) -> int:
        """Loads the model (or finds it loaded) and returns its measured size in bytes."""
        while (model := self._models.get(spec.model_id)) is not None:
            if model.state is State.READY:
                log.info("%s is already loaded", spec.model_id, extra={"model_id": spec.model_id})
                return model.size
            if model.state is State.LOADING:
                return await asyncio.shield(model.load_task)
            await asyncio.shield(model.gone)  # an unload is finishing: then load afresh
        model = Model(spec)
        self._models[spec.model_id] = model
        log.info("loading %s (%s) from %s", spec.model_id, spec.format.name, spec.path,
                 extra={"model_id": spec.model_id})
        model.load_task = asyncio.create_task(self._load(model), name=f"load-{spec.model_id}")
        model.load_task.add_done_callback(functools.partial(self._after_load, model))
        try:
            return await asyncio.shield(model.load_task)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                # The loadModel call itself was cancelled: mesh counts the load as
                # failed and will send unloadModel, which waits for `gone`.
                log.info("load of %s cancelled by the caller", spec.model_id, extra={"model_id": spec.model_id})
                self._discard(model)
                raise
            raise status.load_cancelled(spec.model_id) from None

    async def _load(self, model: Model) -> int:
        spec = model.spec
        timeout_ms = self.settings.loadtime_timeout
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                async with self._load_slots:
                    try:
                        await self._take_workers(model)
                        replies = await asyncio.gather(*(self.pool.channel.request(
                            worker.identity, protocol.OP_LOAD, model_id=spec.model_id,
                            format=spec.format.name, path=spec.path) for worker in model.workers))
                    finally:
                        self.pool.replenish()
                for reply, _ in replies:
                    if not reply["ok"]:
                        raise status.from_worker(spec.model_id, reply)
                sizes = await asyncio.gather(*(asyncio.to_thread(memory.uss, w.pid) for w in model.workers))
        except TimeoutError:
            raise status.load_timed_out(spec.model_id, timeout_ms) from None
        except PeerGone as gone:
            raise status.worker_died(spec.model_id, "load", gone.exit_code) from None
        model.size = sum(sizes)
        model.replicas = ReplicaSet(spec.model_id, model.workers, self.settings.worker_threads,
                                    self.settings.model_queue_max)
        model.state = State.READY
        log.info("loaded %s: %.1f MiB in %.0f ms", spec.model_id, model.size / 2**20,
                 (time.monotonic() - model.load_started) * 1000, extra={"model_id": spec.model_id})
        return model.size

    async def _take_workers(self, model: Model) -> None:
        """MODEL_REPLICAS workers for the model, each recorded the moment it is ours."""
        for _ in range(self.settings.model_replicas):
            worker = await self.pool.take()
            worker.model_id = model.model_id
            model.workers.append(worker)

    def _after_load(self, model: Model, task: asyncio.Task) -> None:
        if task.cancelled():
            self._discard(model)
        elif task.exception() is not None:
            log.warning("load of %s failed: %s", model.model_id, task.exception(),
                        extra={"model_id": model.model_id})
            self._discard(model)

    async def unload(self, model_id: str) -> None:
        """Returns once no worker of the model is alive; at once for an unknown id."""
        model = self._models.get(model_id)
        if model is None:
            return
        grace = UNLOAD_GRACE_SECONDS if model.state is State.READY else 0.0
        model.unload_requested = True
        self._discard(model, grace)
        await asyncio.shield(model.gone)

    async def purge(self) -> None:
        """Unloads every model (mesh restarted and forgot them)."""
        models = list(self._models.values())
        if models:
            log.warning("purging %d models before answering READY: %s",
                        len(models), ", ".join(m.model_id for m in models))
        for model in models:
            model.unload_requested = True
            self._discard(model)
        await asyncio.gather(*(asyncio.shield(m.gone) for m in models))

    async def model_size(self, model_id: str) -> int:
        model = self._ready_model(model_id)
        sizes = await asyncio.gather(*(asyncio.to_thread(memory.uss, w.pid) for w in model.workers))
        model.size = sum(sizes)
        return model.size

    def _discard(self, model: Model, grace: float = 0.0) -> None:
        """Starts removing a model: cancel its load, end its workers; `gone` resolves when done."""
        if model.state is State.UNLOADING:
            return
        model.state = State.UNLOADING
        if model.load_task is not None and not model.load_task.done():
            model.load_task.cancel()
        alive = [w for w in model.workers if w.alive]
        if not alive:
            self._forget(model)
            return
        remaining = set(alive)

        def reaped(worker: Worker, _future) -> None:
            remaining.discard(worker)
            if not remaining:
                self._forget(model)

        loop = asyncio.get_running_loop()
        for worker in alive:
            worker.exited.add_done_callback(functools.partial(reaped, worker))
            if grace > 0:
                worker.signal(signal.SIGTERM)
                loop.call_later(grace, worker.signal, signal.SIGKILL)
            else:
                worker.signal(signal.SIGKILL)

    def _forget(self, model: Model) -> None:
        if self._models.get(model.model_id) is model:
            del self._models[model.model_id]
        if not model.gone.done():
            model.gone.set_result(None)
        log.info("%s unloaded; its memory is back", model.model_id, extra={"model_id": model.model_id})

    def _on_worker_exit(self, worker: Worker, exit_code: int | None) -> None:
        model = self._models.get(worker.model_id) if worker.model_id else None
        # A loading model learns of the death from its pending load request.
        if model is None or model.state is not State.READY or worker not in model.workers:
            return
        log.error("the worker of %s died (%s); the model is dropped", model.model_id,
                  status.describe_exit(exit_code), extra={"model_id": model.model_id})
        self._discard(model)

    # -- inference ------------------------------------------------------------------

    def _ready_model(self, model_id: str) -> Model:
        model = self._models.get(model_id)
        if model is None or model.state is not State.READY:
            raise status.model_not_found(model_id)
        return model

    def is_ready(self, model_id: str) -> bool:
        model = self._models.get(model_id)
        return model is not None and model.state is State.READY

    async def call(self, model_id: str, method: str, request: bytes, timeout: float | None) -> bytes:
        """Forwards a request's bytes to one of the model's workers and returns the response bytes."""
        model = self._ready_model(model_id)
        deadline = time.time() + timeout if timeout is not None else None
        try:
            async with asyncio.timeout(timeout):
                worker = await model.replicas.acquire()
                try:
                    reply, payloads = await self.pool.channel.request(
                        worker.identity, protocol.OP_CALL, [request], method=method, deadline=deadline)
                finally:
                    model.replicas.release(worker)
        except TimeoutError:
            raise status.deadline_exceeded(model_id) from None
        except PeerGone as gone:
            if model.unload_requested:  # the documented race: a request just as mesh unloads
                raise status.model_not_found(model_id) from None
            raise status.worker_died(model_id, "call", gone.exit_code) from None
        if not reply["ok"]:
            worker.errors += 1
            worker.last_error = str(reply.get("message", ""))
            raise status.from_worker(model_id, reply)
        worker.served += 1
        return _joined(payloads, reply.get("append_field"))


def _joined(payloads: list[bytes], append_field: int | None) -> bytes:
    """The response: the first frame, plus each further frame appended as field `append_field`."""
    if len(payloads) == 1:
        return payloads[0]
    parts = [payloads[0]]
    for extra in payloads[1:]:
        parts.append(wire.bytes_field_header(append_field, len(extra)))
        parts.append(extra)
    return b"".join(parts)
