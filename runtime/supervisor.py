"""The model table and each model's life: load, serve, heal, unload, purge.

A model moves LOADING -> READY -> UNLOADING -> (gone), or LOADING -> UNLOADING when its load fails,
times out or is cancelled. Leaving the table always goes through `discard()`: it kills the model's
workers and removes the model only once they are reaped, and `Model.gone` resolves then. So an
unloadModel that awaits `gone` returns with the memory back in the OS, and nothing that finishes
later can bring the model back: the worker that would have done it is dead and the table entry
belongs to nobody.

Inference calls are runtime/dispatch.py's; the memory limit is runtime/watchdog.py's; workers are
asked and killed through the pool.

A worker's death is runtime/healing.py's: it reloads the model, or drops one that keeps crashing.
Small models share packs (runtime/packs.py): a packed model's load and unload go through the pack,
and unload returns once the pack gave the model's memory back (or was recycled).
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import logging
import time

from runtime import memory, modelspec, spares, status
from runtime.channel import PeerGone
from runtime.healing import Healer
from runtime.meshunits import UNIT_BYTES, units_for_models
from runtime.metrics import Metrics
from runtime.model import Model, ModelState
from runtime.modelspec import ModelSpec
from runtime.packs import FILLING_PACKS_MAX, PREDICTED_BASE_PER_FLOOR, Packs
from runtime.pool import WorkerPool
from runtime.settings import Settings
from runtime.watchdog import watch_memory
from runtime.worker import KillCause, Worker
from workers import formats, protocol

log = logging.getLogger("mesh.supervisor")

# How long a worker may take to run its model's close() on unload before SIGKILL.
UNLOAD_GRACE_SECONDS = 2.0
LOAD_OUTCOMES = {"DEADLINE_EXCEEDED": "timeout", "CANCELLED": "cancelled"}
# What a pack's base costs, in spares: the spare it was, and what its first load wrote that
# later loads reuse, measured at half a spare to 0.6 of one (docs/density.md), rounded up.
PACK_BASE_PER_SPARE = 2


def _caller_cancelled() -> bool:
    """Whether the task awaiting a shielded load is itself being cancelled (not just the load)."""
    task = asyncio.current_task()
    assert task is not None  # asyncio runs every coroutine that awaits a future inside a task
    return bool(task.cancelling())


class Supervisor:
    def __init__(self, settings: Settings, metrics: Metrics, pool_factory=WorkerPool):
        """pool_factory(settings, on_worker_exit) makes the pool; tests hand in a fake one."""
        self.settings = settings
        self.metrics = metrics
        self.pool = pool_factory(settings, self._on_worker_exit)
        self.packs = Packs(settings, self.pool, on_recycle=metrics.observe_pack_recycle)
        self.healer = Healer(self)
        self.capacity_bytes = 0  # as last reported to model-mesh
        self._models: dict[str, Model] = {}
        self._load_slots = asyncio.Semaphore(settings.max_loading_concurrency)
        self._watchdog: asyncio.Task | None = None

    @property
    def ready(self) -> bool:
        return self.pool.ready

    def models(self) -> list[Model]:
        return list(self._models.values())

    async def start(self) -> None:
        await self.pool.start()
        await asyncio.to_thread(self.report_capacity)
        if self.settings.worker_memory_limit_bytes:
            self._watchdog = asyncio.create_task(
                watch_memory(self, self.pool, self.settings.worker_memory_limit_bytes), name="memory-watchdog"
            )

    async def close(self) -> list[Worker]:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for model in list(self._models.values()):
            model.unload_requested = True
            self.discard(model)
        return await self.pool.close()

    def capacity(self) -> int:
        """Container memory minus the buffer minus what the front, fork server and spares cost.

        They are counted as the models are (memory.cost(), the kernel's share
        included), so capacity and sizes add up to what the pod is charged.
        Blocking (reads /proc): run it in a thread.
        """
        model_pids = {w.pid for m in self.models() for w in m.workers if w.pid is not None}
        in_packs = self.packs.unclaimed()
        model_pids |= {pid for pid, _ in in_packs if pid is not None}
        overhead = memory.overhead(model_pids) + memory.unclaimed(in_packs) + self.open_packs_reserve()
        total = memory.container_memory(self.settings.container_mem_req_bytes)
        return max(0, total - self.settings.mem_buffer_bytes - overhead)

    def report_capacity(self) -> int:
        """capacity(), kept as what model-mesh is told (the WORKERS_MAX floor follows it). Blocking."""
        self.capacity_bytes = self.capacity()
        return self.capacity_bytes

    def open_packs_reserve(self) -> int:
        """With packs, FILLING_PACKS_MAX packs per format may be open and not yet full (or one per
        replica, each replica going into another pack): their base is only partly in their models'
        sizes (runtime/packs.py), and model-mesh reads capacity once, so the bases of that many
        packs per format that packs hold (python's and the preloaded frameworks') are held back. A
        base is a spare and what the pack's first load wrote: PACK_BASE_PER_SPARE spares' cost.
        Blocking (reads /proc)."""
        if self.settings.models_per_worker <= 1:
            return 0
        spare = max((memory.cost_or_zero(w.pid) for w in self.pool.spares()), default=0)
        packed = [
            f
            for f in formats.FORMATS
            if self.packs.packs_format(f) and (f.framework is None or importlib.util.find_spec(f.framework))
        ]
        open_per_format = max(FILLING_PACKS_MAX, self.settings.model_replicas)
        if not spare:  # none to measure (WORKERS_WARM=0): each base as packs predict one
            return sum(f.size_floor * PREDICTED_BASE_PER_FLOOR for f in packed) * open_per_format
        return spare * PACK_BASE_PER_SPARE * len(packed) * open_per_format

    def worker_share(self, packed: bool) -> int:
        """With WORKERS_MAX, the part of the capacity one worker (or one place in a pack) stands
        for, for every replica; 0 with no cap. Each model is charged at least that: model-mesh
        knows no limit but memory, and would go on sending loads that no worker is left to take.
        Of the capacity, the part model-mesh fills with models, in its units: the cap's worth
        of models fits, and one more does not."""
        settings = self.settings
        if not settings.workers_max:
            return 0
        places = settings.workers_max  # a spare counts against the cap while idle, and takes the last load
        if packed:
            places *= settings.models_per_worker
        units = units_for_models(
            self.capacity_bytes, settings.max_loading_concurrency, settings.default_modelsize
        )
        return units // places * UNIT_BYTES * settings.model_replicas

    def predicted_size(self, spec: ModelSpec) -> int:
        """predictModelSize's answer: conservative, for every replica; a pack's share for a small model."""
        if self.packs.accepts(spec):
            predicted = self.packs.predicted_size(spec) * self.settings.model_replicas
            return max(predicted, self.worker_share(True))
        return max(modelspec.predicted_size(spec, self.settings), self.worker_share(False))

    # -- loading --------------------------------------------------------------------

    async def load(self, spec: ModelSpec) -> int:
        """Loads the model (or finds it loaded) and returns its measured size in bytes."""
        while (model := self._models.get(spec.model_id)) is not None:
            if model.state is ModelState.READY:
                log.info("%s is already loaded", spec.model_id, extra={"model_id": spec.model_id})
                return model.size
            if model.state is ModelState.LOADING:
                # Set right after the model enters the table LOADING, with no await in between.
                assert model.load_task is not None
                try:
                    return await asyncio.shield(model.load_task)
                except asyncio.CancelledError:
                    if _caller_cancelled():
                        raise
                    raise status.load_cancelled(spec.model_id) from None
            await asyncio.shield(model.gone)  # an unload is finishing: then load afresh
        model = Model(spec, self.settings)
        self._models[spec.model_id] = model
        extra = {"model_id": spec.model_id}
        log.info("loading %s (%s) from %s", spec.model_id, spec.format.name, spec.path, extra=extra)
        model.load_task = asyncio.create_task(self._load(model), name=f"load-{spec.model_id}")
        model.load_task.add_done_callback(functools.partial(self._after_load, model))
        try:
            return await asyncio.shield(model.load_task)
        except asyncio.CancelledError:
            if _caller_cancelled():
                # The loadModel call itself was cancelled: mesh counts the load as
                # failed and will send unloadModel, which waits for `gone`.
                log.info(
                    "load of %s cancelled by the caller", spec.model_id, extra={"model_id": spec.model_id}
                )
                self.discard(model)
                raise
            raise status.load_cancelled(spec.model_id) from None
        except Exception:
            # Answer only once nothing of the model is left: its worker is reaped.
            self.discard(model)
            await asyncio.shield(model.gone)
            raise

    async def _load(self, model: Model) -> int:
        spec = model.spec
        timeout_ms = self.settings.loadtime_timeout
        spares.waiting_for.set(
            f"one of MAX_LOADING_CONCURRENCY={self.settings.max_loading_concurrency} loads to end"
        )
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                async with self._load_slots:
                    spares.waiting_for.set(None)
                    if self.packs.accepts(spec):
                        sizes = await self._load_packed(model)
                    else:
                        sizes = await self._load_own_workers(model)
        except TimeoutError:
            raise status.load_timed_out(spec.model_id, timeout_ms, spares.waiting_for.get()) from None
        except PeerGone as gone:
            raise status.worker_died(spec.model_id, "load", gone.exit_code, gone.cause) from None
        finally:
            # Replace the spares only now: on two cores a fork during the load
            # (or its measurement) slows it down.
            self.pool.replenish()
        # A worker may die after its reply and before this point; its exit handler
        # ignored it (the model was loading), so the load must see it now.
        for worker, size in zip(model.workers, sizes, strict=True):
            if not worker.serving or not size:
                raise status.worker_died(spec.model_id, "load", worker.exit_code(), worker.death_cause)
        model.size = max(sum(sizes), self.worker_share(model.packed))
        for worker in model.workers:
            model.replicas.add(worker)
        model.change_state(ModelState.READY)
        log.info(
            "loaded %s: %.1f MiB in %.0f ms",
            spec.model_id,
            model.size / 2**20,
            (time.monotonic() - model.load_started) * 1000,
            extra={"model_id": spec.model_id},
        )
        return model.size

    async def _load_own_workers(self, model: Model) -> list[int]:
        """Loads the model into MODEL_REPLICAS spares of its own; their measured sizes."""
        for _ in range(self.settings.model_replicas):
            await self.take_worker(model)
        replies = await asyncio.gather(*(self.send_load(model, w) for w in model.workers))
        for reply in replies:
            if not reply["ok"]:
                raise status.from_worker(model.model_id, reply)
        charged = [(w.pid, model.spec.format.first_calls_bytes) for w in model.workers]
        return await asyncio.to_thread(memory.serving_costs, charged)

    async def _load_packed(self, model: Model) -> list[int]:
        """Loads the model into MODEL_REPLICAS packs; what it added to each. It moves to workers of its
        own if it adds over MODEL_PACK_MAX_BYTES, leaves processes running, or fails in a pack (as a
        model.py that registers a metric at import does the second time: a pack's first loads twice)."""
        model.packed, loads = True, []
        for _ in range(self.settings.model_replicas):
            loads.append(loaded := await self.packs.load(model, avoid=model.workers))
            if not loaded.reply["ok"]:
                if loaded.reply.get("error") != protocol.ERROR_LOAD:
                    raise status.from_worker(model.model_id, loaded.reply)
                why = f"failed to load in a pack ({str(loaded.reply.get('message'))[:200]})"
                break
            model.workers.append(loaded.worker)
        else:
            sizes = [loaded.size for loaded in loads]
            if any(loaded.started_processes for loaded in loads):
                why = "left processes running below its pack"  # measured right only as a tree of its own
            elif max(sizes) > self.settings.model_pack_max_bytes:
                why = f"added {max(sizes) / 2**20:.1f} MiB to its pack, over MODEL_PACK_MAX_BYTES"
            else:
                return sizes
        log.info(
            "%s %s: it moves to a worker of its own", model.model_id, why, extra={"model_id": model.model_id}
        )
        self.packs.note_left(model.spec)
        await self.packs.remove(model)
        model.workers.clear()
        model.packed = False
        return await self._load_own_workers(model)

    async def take_worker(self, model: Model) -> Worker:
        """A spare for the model, recorded as the model's the moment it is ours."""
        worker = await self.pool.take(model.spec.format.name)
        worker.model_id = model.model_id
        model.workers.append(worker)
        return worker

    def send_load(self, model: Model, worker: Worker):
        return self.pool.send_load(worker, model.model_id, model.spec.format.name, model.spec.path)

    def _after_load(self, model: Model, task: asyncio.Task) -> None:
        seconds = time.monotonic() - model.load_started
        if task.cancelled():
            self.metrics.observe_load("cancelled", seconds)
            self.discard(model)
        elif task.exception() is not None:
            error = task.exception()
            code = error.code.name if isinstance(error, status.RpcError) else "INTERNAL"
            self.metrics.observe_load(LOAD_OUTCOMES.get(code, "failed"), seconds)
            log.warning("load of %s failed: %s", model.model_id, error, extra={"model_id": model.model_id})
            self.discard(model)
        else:
            self.metrics.observe_load("ok", seconds)
        # What the load allocated here and freed goes back too: else the front's heap floats by a
        # few hundred KiB until the next exit or unload, and a load measured beside it seems off.
        self.pool.heap.note()

    # -- unloading --------------------------------------------------------------------

    async def unload(self, model_id: str) -> None:
        """Returns once no worker of the model is alive; at once for an unknown id."""
        model = self._models.get(model_id)
        if model is None:
            return
        grace = UNLOAD_GRACE_SECONDS if model.state is ModelState.READY else 0.0
        model.unload_requested = True
        self.discard(model, grace)
        await asyncio.shield(model.gone)

    async def purge(self) -> None:
        """Unloads every model (mesh restarted and forgot them)."""
        models = list(self._models.values())
        if models:
            log.warning(
                "purging %d models before answering READY: %s",
                len(models),
                ", ".join(m.model_id for m in models),
            )
        for model in models:
            model.unload_requested = True
            self.discard(model)
        await asyncio.gather(*(asyncio.shield(m.gone) for m in models))

    def discard(self, model: Model, grace: float = 0.0) -> None:
        """Starts removing a model: stop its load or heal, end its workers; `gone` resolves when done."""
        if model.state is ModelState.UNLOADING:
            return
        model.change_state(ModelState.UNLOADING)
        # Gone once they end too: cancelled in a pack's drop, one runs that drop to its end.
        endings: list[asyncio.Future] = [t for t in (model.load_task, model.heal_task) if t and not t.done()]
        for task in endings:
            task.cancel()
        model.replicas.fail_line(status.model_not_found(model.model_id))
        own = [w for w in model.workers if w.alive and not w.packed]
        endings += [w.exited for w in own]
        if model.packed:
            endings.append(asyncio.ensure_future(self.packs.remove(model)))
        for worker in own:
            self.pool.kill(worker, KillCause.UNLOAD, f"{model.model_id} is unloaded", grace)
        if not endings:
            self._forget(model)
            return
        # Gone once every worker of its own is reaped and every pack gave its memory back.
        ended = asyncio.gather(*endings, return_exceptions=True)
        ended.add_done_callback(lambda _: self._forget(model))

    def _forget(self, model: Model) -> None:
        if self._models.get(model.model_id) is model:
            del self._models[model.model_id]
            self.metrics.forget_model(model.model_id, unloaded=model.was_ready)
        if not model.gone.done():
            model.gone.set_result(None)
        self.pool.heap.note()  # a packed model's unload reaps no worker, whose exit would note it
        log.info("%s; its memory is back", model.end_told(), extra={"model_id": model.model_id})

    # -- healing (runtime/healing.py) -------------------------------------------------

    def _on_worker_exit(self, worker: Worker, exit_code: int | None) -> None:
        self.healer.on_worker_exit(worker, exit_code)

    # -- the table, as others read it ------------------------------------------------

    def ready_model(self, model_id: str) -> Model:
        """The model, if it is loaded and ready; else NOT_FOUND."""
        model = self._models.get(model_id)
        if model is None or model.state is not ModelState.READY:
            raise status.model_not_found(model_id)
        return model

    def get(self, model_id: str) -> Model | None:
        """The model in the table, in whatever state."""
        return self._models.get(model_id)

    def is_known(self, model_id: str) -> bool:
        return model_id in self._models

    def is_ready(self, model_id: str) -> bool:
        model = self._models.get(model_id)
        return model is not None and model.state is ModelState.READY

    async def model_size(self, model_id: str) -> int:
        model = self.ready_model(model_id)
        if model.packed:  # a pack's later growth is no one model's: capacity counts it
            model.size = max(self.packs.size_of(model) or model.size, self.worker_share(True))
            return model.size
        first_calls = model.spec.format.first_calls_bytes
        workers = [(w.pid, 0 if w.served else first_calls) for w in model.replicas.workers]
        sizes = await asyncio.to_thread(memory.serving_costs, workers)
        if len(sizes) == self.settings.model_replicas and all(sizes):
            model.size = max(sum(sizes), self.worker_share(False))
        return model.size  # while healing: the last full measurement
