"""The model table and each model's life: load, serve, heal, unload, purge.

A model moves LOADING -> READY -> UNLOADING -> (gone), or LOADING -> UNLOADING
when its load fails, times out or is cancelled. Leaving the table always goes
through `_discard()`: it kills the model's workers and removes the model only
once they are reaped, and `Model.gone` resolves then. So an unloadModel that
awaits `gone` returns with the memory back in the OS, and nothing that
finishes later can bring the model back: the worker that would have done it
is dead and the table entry belongs to nobody.

Inference calls are runtime/dispatch.py's; the memory limit is
runtime/watchdog.py's; workers are asked and killed through the pool.

Healing: when a worker of a READY model dies (crash, OOM kill, or killed by
the front as hung or over its memory limit), its calls fail at once
(UNAVAILABLE, or RESOURCE_EXHAUSTED for the memory limit) and a fresh worker
reloads the model after a capped backoff; calls that arrive meanwhile wait in
the model's line. A model that dies MODEL_CRASH_LIMIT times within
MODEL_CRASH_WINDOW_MS is dropped, so it answers NOT_FOUND and model-mesh
places it elsewhere.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time

from runtime import memory, status
from runtime.channel import PeerGone
from runtime.metrics import Metrics
from runtime.model import Model, ModelState
from runtime.modelspec import ModelSpec
from runtime.pool import WorkerPool
from runtime.settings import Settings
from runtime.watchdog import watch_memory
from runtime.worker import KillCause, Worker

log = logging.getLogger("mesh.supervisor")

# How long a worker may take to run its model's close() on unload before SIGKILL.
UNLOAD_GRACE_SECONDS = 2.0
# Reload after the n-th recent crash waits HEAL_BACKOFF_SECONDS * 2**(n-1), at most the cap.
HEAL_BACKOFF_SECONDS = 0.1
HEAL_BACKOFF_CAP_SECONDS = 5.0
LOAD_OUTCOMES = {"DEADLINE_EXCEEDED": "timeout", "CANCELLED": "cancelled"}


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
        await asyncio.to_thread(self.capacity)
        if self.settings.worker_memory_limit_bytes:
            self._watchdog = asyncio.create_task(
                watch_memory(self, self.pool, self.settings.worker_memory_limit_bytes), name="memory-watchdog"
            )

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        for model in list(self._models.values()):
            model.unload_requested = True
            self._discard(model)
        await self.pool.close()

    def capacity(self) -> int:
        """Container memory minus the buffer minus what the front, fork server and spares cost.

        They are counted as the models are (memory.cost(), the kernel's share
        included), so capacity and sizes add up to what the pod is charged.
        Blocking (reads /proc): run it in a thread.
        """
        model_pids = {w.pid for m in self.models() for w in m.workers if w.pid is not None}
        overhead = memory.overhead(model_pids)
        total = memory.container_memory(self.settings.container_mem_req_bytes)
        self.capacity_bytes = max(0, total - self.settings.mem_buffer_bytes - overhead)
        return self.capacity_bytes

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
        log.info(
            "loading %s (%s) from %s",
            spec.model_id,
            spec.format.name,
            spec.path,
            extra={"model_id": spec.model_id},
        )
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
                self._discard(model)
                raise
            raise status.load_cancelled(spec.model_id) from None
        except Exception:
            # Answer only once nothing of the model is left: its worker is reaped.
            self._discard(model)
            await asyncio.shield(model.gone)
            raise

    async def _load(self, model: Model) -> int:
        spec = model.spec
        timeout_ms = self.settings.loadtime_timeout
        try:
            async with asyncio.timeout(timeout_ms / 1000):
                async with self._load_slots:
                    for _ in range(self.settings.model_replicas):
                        await self._take_worker(model)
                    replies = await asyncio.gather(*(self._send_load(model, w) for w in model.workers))
                for reply in replies:
                    if not reply["ok"]:
                        raise status.from_worker(spec.model_id, reply)
                charged = [(w.pid, spec.format.first_calls_bytes) for w in model.workers]
                sizes = await asyncio.to_thread(memory.serving_costs, charged)
        except TimeoutError:
            raise status.load_timed_out(spec.model_id, timeout_ms) from None
        except PeerGone as gone:
            raise status.worker_died(spec.model_id, "load", gone.exit_code) from None
        finally:
            # Replace the spares only now: on two cores a fork during the load
            # (or its measurement) slows it down.
            self.pool.replenish()
        # A worker may die after its reply and before this point; its exit handler
        # ignored it (the model was loading), so the load must see it now.
        for worker, size in zip(model.workers, sizes, strict=True):
            if not worker.serving or not size:
                exit_code = worker.exited.result() if worker.exited.done() else None
                raise status.worker_died(spec.model_id, "load", exit_code)
        model.size = sum(sizes)
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

    async def _take_worker(self, model: Model) -> Worker:
        """A spare for the model, recorded as the model's the moment it is ours."""
        worker = await self.pool.take(model.spec.format.name)
        worker.model_id = model.model_id
        model.workers.append(worker)
        return worker

    def _send_load(self, model: Model, worker: Worker):
        return self.pool.send_load(worker, model.model_id, model.spec.format.name, model.spec.path)

    def _after_load(self, model: Model, task: asyncio.Task) -> None:
        seconds = time.monotonic() - model.load_started
        if task.cancelled():
            self.metrics.observe_load("cancelled", seconds)
            self._discard(model)
        elif task.exception() is not None:
            error = task.exception()
            code = error.code.name if isinstance(error, status.RpcError) else "INTERNAL"
            self.metrics.observe_load(LOAD_OUTCOMES.get(code, "failed"), seconds)
            log.warning("load of %s failed: %s", model.model_id, error, extra={"model_id": model.model_id})
            self._discard(model)
        else:
            self.metrics.observe_load("ok", seconds)

    # -- unloading --------------------------------------------------------------------

    async def unload(self, model_id: str) -> None:
        """Returns once no worker of the model is alive; at once for an unknown id."""
        model = self._models.get(model_id)
        if model is None:
            return
        grace = UNLOAD_GRACE_SECONDS if model.state is ModelState.READY else 0.0
        model.unload_requested = True
        self._discard(model, grace)
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
            self._discard(model)
        await asyncio.gather(*(asyncio.shield(m.gone) for m in models))

    def _discard(self, model: Model, grace: float = 0.0) -> None:
        """Starts removing a model: stop its load or heal, end its workers; `gone` resolves when done."""
        if model.state is ModelState.UNLOADING:
            return
        model.change_state(ModelState.UNLOADING)
        for task in (model.load_task, model.heal_task):
            if task is not None and not task.done():
                task.cancel()
        model.replicas.fail_line(status.model_not_found(model.model_id))
        alive = [w for w in model.workers if w.alive]
        if not alive:
            self._forget(model)
            return
        remaining = set(alive)

        def reaped(worker: Worker, _future) -> None:
            remaining.discard(worker)
            if not remaining:
                self._forget(model)

        for worker in alive:
            worker.exited.add_done_callback(functools.partial(reaped, worker))
            self.pool.kill(worker, KillCause.UNLOAD, f"{model.model_id} is unloaded", grace)

    def _forget(self, model: Model) -> None:
        if self._models.get(model.model_id) is model:
            del self._models[model.model_id]
            self.metrics.forget_model(model.model_id)
        if not model.gone.done():
            model.gone.set_result(None)
        log.info("%s unloaded; its memory is back", model.model_id, extra={"model_id": model.model_id})

    # -- healing ------------------------------------------------------------------------

    def _on_worker_exit(self, worker: Worker, exit_code: int | None) -> None:
        model = self._models.get(worker.model_id) if worker.model_id else None
        # A loading model learns of the death from its pending load request.
        if model is None or model.state is not ModelState.READY or worker not in model.workers:
            return
        model.workers.remove(worker)
        model.replicas.remove(worker)
        cause = worker.kill_reason or status.describe_exit(exit_code)
        self.metrics.observe_restart(model.model_id, worker.death_label)
        if self._crash_limit_reached(model):
            log.error(
                "dropping %s: its workers died %d times within %d ms (last: %s); "
                "model-mesh will place it elsewhere",
                model.model_id,
                len(model.crashes),
                self.settings.model_crash_window_ms,
                cause,
                extra={"model_id": model.model_id},
            )
            self._discard(model)
            return
        log.error(
            "the worker of %s died (%s); healing", model.model_id, cause, extra={"model_id": model.model_id}
        )
        if model.heal_task is None or model.heal_task.done():
            model.heal_task = asyncio.create_task(self._heal(model), name=f"heal-{model.model_id}")

    def _crash_limit_reached(self, model: Model) -> bool:
        now = time.monotonic()
        model.crashes.append(now)
        while model.crashes and now - model.crashes[0] > self.settings.model_crash_window_ms / 1000:
            model.crashes.popleft()
        return len(model.crashes) >= self.settings.model_crash_limit

    async def _heal(self, model: Model) -> None:
        """Reloads the model into fresh workers until it has all its replicas again."""
        while model.state is ModelState.READY and len(model.workers) < self.settings.model_replicas:
            await asyncio.sleep(
                min(HEAL_BACKOFF_CAP_SECONDS, HEAL_BACKOFF_SECONDS * 2 ** (len(model.crashes) - 1))
            )
            try:
                worker = await self._take_worker(model)
            except status.RpcError as error:  # WORKERS_MAX: no process to heal into
                log.error(
                    "dropping %s: cannot heal it: %s",
                    model.model_id,
                    error.message,
                    extra={"model_id": model.model_id},
                )
                self._discard(model)
                return
            try:
                async with asyncio.timeout(self.settings.loadtime_timeout / 1000):
                    reply = await self._send_load(model, worker)
            except (PeerGone, TimeoutError):
                reply = {"ok": False, "message": "the reload did not finish"}
            finally:
                self.pool.replenish()
            if reply["ok"] and worker.serving:
                model.replicas.add(worker)
                log.info(
                    "healed %s: %r serves it", model.model_id, worker, extra={"model_id": model.model_id}
                )
            else:
                # Counted as a crash by _on_worker_exit, which may drop the model.
                self.pool.kill(
                    worker,
                    KillCause.RELOAD_FAILED,
                    f"reload failed: {reply.get('message', 'its worker died')}",
                )
                await asyncio.shield(worker.exited)

    # -- the table, as others read it ------------------------------------------------

    def ready_model(self, model_id: str) -> Model:
        """The model, if it is loaded and ready; else NOT_FOUND."""
        model = self._models.get(model_id)
        if model is None or model.state is not ModelState.READY:
            raise status.model_not_found(model_id)
        return model

    def is_known(self, model_id: str) -> bool:
        return model_id in self._models

    def is_ready(self, model_id: str) -> bool:
        model = self._models.get(model_id)
        return model is not None and model.state is ModelState.READY

    async def model_size(self, model_id: str) -> int:
        model = self.ready_model(model_id)
        first_calls = model.spec.format.first_calls_bytes
        workers = [(w.pid, 0 if w.served else first_calls) for w in model.replicas.workers]
        sizes = await asyncio.to_thread(memory.serving_costs, workers)
        if len(sizes) == self.settings.model_replicas and all(sizes):
            model.size = sum(sizes)
        return model.size  # while healing: the last full measurement
