"""Healing: a worker of a READY model died, so the model reloads elsewhere or is dropped.

When a worker dies (crash, OOM kill, or killed by the front as hung or over
its memory limit), its calls fail at once (UNAVAILABLE, or
RESOURCE_EXHAUSTED for the memory limit) and a fresh worker reloads the
model after a capped backoff; calls that arrive meanwhile wait in the
model's line. A model that dies MODEL_CRASH_LIMIT times within
MODEL_CRASH_WINDOW_MS is dropped, so it answers NOT_FOUND and model-mesh
places it elsewhere.

A pack's death (runtime/packs.py) hits every model in it: each heals into
another pack, and the crash counts against the model whose code the pack was
running (blamed() below), so a model that crashes its packs is
dropped and its neighbours are not. A pack the front ended for a recycle
counts against none of the models left in it (those that could not move).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING

from runtime import status
from runtime.channel import PeerGone
from runtime.model import Model, ModelState
from runtime.worker import KillCause, Worker
from workers import protocol

if TYPE_CHECKING:
    from runtime.supervisor import Supervisor

log = logging.getLogger("mesh.supervisor")

# Reload after the n-th recent crash waits HEAL_BACKOFF_SECONDS * 2**(n-1), at most the cap.
HEAL_BACKOFF_SECONDS = 0.1
HEAL_BACKOFF_CAP_SECONDS = 5.0


class Healer:
    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor
        self.settings = supervisor.settings
        self.metrics = supervisor.metrics
        self.pool = supervisor.pool
        self.packs = supervisor.packs
        self._reloading_packed: collections.Counter[str] = collections.Counter()  # by format

    def on_worker_exit(self, worker: Worker, exit_code: int | None) -> None:
        if worker.packed:
            members = self.packs.forget(worker)
        else:
            model = self.supervisor.get(worker.model_id) if worker.model_id else None
            members = [model] if model is not None else []
        # A loading model learns of the death from its pending load request.
        hit = [m for m in members if m.state is ModelState.READY and worker in m.workers]
        # A recycled pack's models that did not move are not to blame for its end, nor any model for
        # its fork server's death.
        innocent = worker.kill_cause is KillCause.RECYCLED or worker.orphaned
        at_fault = [] if innocent else blamed(hit, worker)
        for model in hit:
            self._lose_worker(model, worker, exit_code, model in at_fault)

    def _lose_worker(self, model: Model, worker: Worker, exit_code: int | None, blamed: bool) -> None:
        """A worker of the READY model died: heal, or drop a model that keeps crashing."""
        model.workers.remove(worker)
        model.replicas.remove(worker)
        cause = worker.death_cause or worker.kill_reason or status.describe_exit(exit_code)
        self.metrics.observe_restart(model.model_id, worker.death_label)
        if blamed and self._crash_limit_reached(model):
            log.error(
                "dropping %s: its workers died %d times within %d ms (last: %s); "
                "model-mesh will place it elsewhere",
                model.model_id,
                len(model.crashes),
                self.settings.model_crash_window_ms,
                cause,
                extra={"model_id": model.model_id},
            )
            self.supervisor.discard(model)
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
            # Again: a pack that died as the model moved out of it (runtime/repacking.py) may have
            # moved it into another, which gave it its replica back.
            await self.packs.move_ended(model)
            if model.state is not ModelState.READY or len(model.workers) >= self.settings.model_replicas:
                return
            if model.packed:
                await self._heal_into_a_pack(model)
                continue
            try:
                worker = await self.supervisor.take_worker(model)
            except status.RpcError as error:  # WORKERS_MAX, or workers that do not start
                if not self._keeps_serving_without(model, error):
                    return
                await asyncio.sleep(HEAL_BACKOFF_CAP_SECONDS)
                continue
            try:
                async with asyncio.timeout(self.settings.loadtime_timeout / 1000):
                    reply = await self.supervisor.send_load(model, worker)
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

    def _keeps_serving_without(self, model: Model, error: status.RpcError) -> bool:
        """No worker to heal into: a model whose other replicas serve goes on with them (tried again
        later), one with none is dropped, for model-mesh to place elsewhere."""
        if model.workers:
            log.warning(
                "%s serves on %d of its %d replicas: cannot heal the others now (%s); trying again",
                model.model_id,
                len(model.workers),
                self.settings.model_replicas,
                error.message,
                extra={"model_id": model.model_id},
            )
            return True
        log.error(
            "dropping %s: cannot heal it: %s",
            model.model_id,
            error.message,
            extra={"model_id": model.model_id},
        )
        self.supervisor.discard(model)
        return False

    async def _heal_into_a_pack(self, model: Model) -> None:
        """One replica of a packed model reloaded into a pack; a failure counts as a crash.

        The models of a dead pack all reload at once, into whatever packs have room, new ones
        among them; once the last of them is in, the format's packs are compacted."""
        format_name = model.spec.format.name
        self._reloading_packed[format_name] += 1
        try:
            await self._reload_into_a_pack(model)
        finally:
            self._reloading_packed[format_name] -= 1
        if not self._reloading_packed[format_name]:
            del self._reloading_packed[format_name]
            # Shielded: unloading this model cancels its heal, which must not stop the series of
            # compactions (each move runs to its end anyway: runtime/repacking.py to_the_end).
            await asyncio.shield(self.packs.compact_all(format_name))

    async def _reload_into_a_pack(self, model: Model) -> None:
        reply: dict = {"ok": False, "message": "the reload did not finish"}
        worker, started = None, False
        try:
            async with asyncio.timeout(self.settings.loadtime_timeout / 1000):
                worker, reply, _, started = await self.packs.load(model, avoid=model.workers)
        except status.RpcError as error:  # WORKERS_MAX: no process to heal into
            reply = {"ok": False, "message": error.message}
        except (PeerGone, TimeoutError):
            pass
        finally:
            self.pool.replenish()
        if reply["ok"] and len(model.workers) >= self.settings.model_replicas:
            await self.packs.remove(model, keep=model.workers)  # a move gave it its replicas meanwhile
            return
        if reply["ok"] and worker is not None and worker.serving and model.ready:
            model.workers.append(worker)
            model.replicas.add(worker)
            log.info("healed %s: %r serves it", model.model_id, worker, extra={"model_id": model.model_id})
            if started:  # its size stands as it was reported: only its next loadModel can change it
                self.packs.note_left(model.spec)
                log.warning(
                    "%s left processes running below %r as it reloaded: measured in the pack, it may "
                    "be more than its size; its next load gives it a worker of its own",
                    model.model_id,
                    worker,
                    extra={"model_id": model.model_id},
                )
            return
        await self.packs.remove(model, keep=model.workers)
        if model.ready and self._crash_limit_reached(model):
            log.error(
                "dropping %s: its reloads keep failing (last: %s)",
                model.model_id,
                reply.get("message"),
                extra={"model_id": model.model_id},
            )
            self.supervisor.discard(model)


def blamed(models: list[Model], worker: Worker) -> list[Model]:
    """The models a pack's death counts against, of the ready `models` it held.

    Its main thread says in the beat file whose call, load or drop it runs
    (with call threads, its loads and drops alone): that model alone, none of
    these if it was a load (that load fails) or a drop, even with calls on
    call threads beside it: a model whose call crashed the pack then is not
    counted this once, rather than a neighbour whose call merely ran. Else,
    with call threads, which say nothing, those with calls in it. Else (it
    died idle: killed from outside, or for its memory) all of them.
    """
    if worker.last_running != protocol.NOTHING_RUNNING:
        return [m for m in models if protocol.model_tag(m.model_id) == worker.last_running]
    running = [m for m in models if m.model_id in worker.running]
    return running or models
