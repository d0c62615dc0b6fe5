"""Packs: worker processes that each hold several small models.

With MODELS_PER_WORKER > 1, a model whose predicted size without its
format's floor (bytes on disk x MODELSIZE_MULTIPLIER) is below
MODEL_PACK_MAX_BYTES goes into a pack of its fork server that has room, or
into a spare that becomes a new pack. Each replica goes into another pack.

Every load into a pack and every drop from it runs alone (the pack's lock)
and is measured from outside the process, before and after, kernel share
included (runtime/memory.py). A new pack loads its first model twice, the
first time dropped at once, and its base is what it costs then: the spare,
and what a first load writes that later loads reuse. A model's size is what
the pack grew by that no model is charged for yet (its load, and what the
calls since the last load added; at least PACKED_MODEL_MIN_BYTES), its share
of the base (over MODELS_PER_WORKER) and what the front holds for it:
model-mesh reads capacity only once, at start, so a pack's base must be in
the sizes of the models that fill it.
What the drop gave back is checked against what the load added. A pack that did not shrink by that, less
RECYCLE_SLACK_BYTES, is recycled before the unload returns:
a fresh worker loads the survivors, their calls move to it (calls already
sent finish in the old one), and the old one is killed once it has
answered them, and reaped. A load that was abandoned (cancelled, timed out:
the pack may still be running it) ends the same way, and so does a failed
load that left memory behind. What the pack costs beyond its models'
sizes (a pack not yet full) is counted in capacity (`unclaimed()`).

A pack that dies takes only its own models down; the supervisor heals them
into other packs and counts the crash against the models that had calls
in it (runtime/supervisor.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

from runtime import memory, status
from runtime.channel import PeerGone
from runtime.model import Model
from runtime.modelspec import ModelSpec
from runtime.pool import WorkerPool
from runtime.settings import Settings
from runtime.worker import KillCause, Worker

log = logging.getLogger("mesh.packs")

# What a drop may fail to give back before the pack is recycled: heap pages
# that stay partly used by the survivors, allocator bookkeeping.
RECYCLE_SLACK_BYTES = 128 * 1024
# The least a packed model's load is charged: a load that reused heap the
# pack had freed grows it by less than the model holds. What one model is
# charged beyond its growth is credit that the next loads' growth uses up.
PACKED_MODEL_MIN_BYTES = 8 * 1024
# The least a model is predicted to add to its pack before it is loaded: above what tiny
# models were measured to add (docs/density.md), so that predictModelSize stays conservative.
PACKED_PREDICTION_MIN_BYTES = 256 * 1024
# A pack's base, predicted in floors of its format before any pack of it has measured one.
PREDICTED_BASE_PER_FLOOR = 2
# How long a recycled pack may take to answer the calls already sent to it.
DRAIN_SECONDS = 10.0


class Pack:
    def __init__(self, worker: Worker, format_name: str):
        self.worker = worker
        self.format_name = format_name  # a pack holds models of one format
        self.members: dict[str, Model] = {}  # placed here: loading or loaded
        self.charged: dict[str, int] = {}  # loaded: model id -> its reported size
        self.growth_charged: dict[str, int] = {}  # loaded: model id -> the part of its size not base
        self.grown: dict[str, int] = {}  # loaded: model id -> what its load added, measured
        self.lock = asyncio.Lock()  # one load or drop at a time: each is measured before and after
        self.open = True  # takes new models; False once it is recycled, emptied or dead
        self.abandoned = False  # a load was given up while the pack may still run it
        self.base_bytes = 0  # what it cost once it rehearsed its first load, its share of the front included


class Packs:
    def __init__(self, settings: Settings, pool: WorkerPool, on_recycle=None):
        """on_recycle(seconds, models_moved) is told of every recycle (metrics)."""
        self.settings = settings
        self.pool = pool
        self._on_recycle = on_recycle
        self._packs: dict[Worker, Pack] = {}

    def accepts(self, spec: ModelSpec) -> bool:
        """Whether the model goes into a pack."""
        estimate = spec.disk_bytes * self.settings.modelsize_multiplier
        return self.settings.models_per_worker > 1 and estimate < self.settings.model_pack_max_bytes

    def predicted_size(self, spec: ModelSpec) -> int:
        """A conservative size for one copy of a model that will go into a pack: what its load
        may add, its share of a base (the largest its format's packs measured, else
        PREDICTED_BASE_PER_FLOOR floors of the format), and what the front holds for it."""
        format_name = spec.format.name
        bases = [p.base_bytes for p in self._packs.values() if p.format_name == format_name]
        base = max(bases, default=0) or spec.format.size_floor * PREDICTED_BASE_PER_FLOOR
        load = max(int(spec.disk_bytes * self.settings.modelsize_multiplier), PACKED_PREDICTION_MIN_BYTES)
        return load + base // self.settings.models_per_worker + memory.FRONT_MODEL_BYTES

    def of(self, worker: Worker) -> Pack | None:
        return self._packs.get(worker)

    def size_of(self, model: Model) -> int:
        """What the model's loads added to its packs, in all."""
        return sum(pack.charged.get(model.model_id, 0) for pack in self._packs.values())

    def unclaimed(self) -> list[tuple[int | None, int]]:
        """(pid, bytes of it its models are charged) of each pack: capacity counts the rest."""
        return [
            (pack.worker.pid, sum(pack.charged.values()) - memory.FRONT_MODEL_BYTES * len(pack.charged))
            for pack in self._packs.values()
        ]

    # -- loading ----------------------------------------------------------------------

    async def load(self, model: Model, avoid: list[Worker]) -> tuple[Worker, dict, int]:
        """Loads the model into a pack (not one in `avoid`); (its worker, the reply, bytes charged).

        The charge is 0 when the load failed. Raises PeerGone if the pack dies.
        """
        while True:
            pack = await self._place(model, avoid)
            async with pack.lock:
                if pack.open and model.model_id in pack.members:
                    reply, size = await self._load_into(pack, model)
                    return pack.worker, reply, size
            pack.members.pop(model.model_id, None)  # recycled or emptied while we waited: again

    async def _place(self, model: Model, avoid: list[Worker]) -> Pack:
        """A pack with room for the model, its place taken at once; a spare becomes one if none has."""
        format_name = model.spec.format.name
        fits = [
            pack
            for pack in self._packs.values()
            if pack.open
            and pack.format_name == format_name
            and pack.worker.alive
            and pack.worker not in avoid
            and model.model_id not in pack.members
            and len(pack.members) < self.settings.models_per_worker
        ]
        if fits:
            # The fullest free one: fewer processes in all, and two loads at once do not queue.
            pack = max(fits, key=lambda p: (not p.lock.locked(), len(p.members)))
        else:
            worker = await self.pool.take(format_name)
            pack = self._packs[worker] = Pack(worker, format_name)
        pack.members[model.model_id] = model
        return pack

    async def _load_into(self, pack: Pack, model: Model) -> tuple[dict, int]:
        """Holding the pack's lock: load, measured from outside before and after."""
        worker = pack.worker
        if not pack.base_bytes:
            reply = await self._rehearse(pack, model)
            if not reply["ok"]:
                return await self._failed(pack, model, reply, left=0)
        before = memory.anonymous(worker.pid)
        reply = await self._send_load(pack, model)
        if reply["ok"]:
            # Charged at once: a drop must follow even if the measuring is cancelled.
            pack.charged[model.model_id] = PACKED_MODEL_MIN_BYTES
        added = memory.anonymous(worker.pid) - before
        if not reply["ok"]:
            return await self._failed(pack, model, reply, left=added)
        pack.grown[model.model_id] = max(0, added)
        measured = await asyncio.to_thread(memory.cost_or_zero, worker.pid)
        return reply, self._charge(pack, model.model_id, measured)

    async def _rehearse(self, pack: Pack, model: Model) -> dict:
        """A new pack loads its first model once and drops it before the load that counts.

        What a pack's first load writes that later loads reuse (imports, caches,
        pages copied from the fork server) is so in the base, measured after, and
        not in the first model's size. The reply of the rehearsal load.
        """
        reply = await self._send_load(pack, model)
        if reply["ok"]:
            await self.pool.send_drop(pack.worker, model.model_id)
            cost = await asyncio.to_thread(memory.cost_or_zero, pack.worker.pid)
            pack.base_bytes = cost + memory.FRONT_SHARE_BYTES
        return reply

    async def _send_load(self, pack: Pack, model: Model) -> dict:
        model_id, spec = model.model_id, model.spec
        try:
            return await self.pool.send_load(pack.worker, model_id, spec.format.name, spec.path, pack=True)
        except asyncio.CancelledError:
            pack.abandoned = True  # the worker may still be loading it
            raise

    async def _failed(self, pack: Pack, model: Model, reply: dict, left: int) -> tuple[dict, int]:
        """A load the pack refused: the pack ends if it holds nothing, or is recycled if the load
        left `left` bytes behind; (the reply, 0 bytes charged)."""
        pack.members.pop(model.model_id, None)
        pack.worker.models.discard(model.model_id)
        if not pack.charged:
            await self._end(pack, f"its first load ({model.model_id}) failed")
        elif left > RECYCLE_SLACK_BYTES:
            await self._recycle(pack, f"the failed load of {model.model_id} left {left} bytes")
        return reply, 0

    def _charge(self, pack: Pack, model_id: str, measured: int) -> int:
        """The model's size, now that the pack costs `measured`: what no model is charged for yet (at
        least PACKED_MODEL_MIN_BYTES), its share of the base, and what the front holds for it.

        So the sizes of a pack's models add up to at least what it grew by, and a load that only
        refilled heap freed before is not charged that heap a second time.
        """
        others = sum(charge for other, charge in pack.growth_charged.items() if other != model_id)
        uncharged = measured + memory.FRONT_SHARE_BYTES - pack.base_bytes - others
        growth = max(uncharged, PACKED_MODEL_MIN_BYTES)
        size = growth + pack.base_bytes // self.settings.models_per_worker + memory.FRONT_MODEL_BYTES
        pack.growth_charged[model_id] = growth
        pack.charged[model_id] = size
        return size

    # -- unloading --------------------------------------------------------------------

    async def remove(self, model: Model, keep: list[Worker] | tuple = ()) -> None:
        """Takes the model out of every pack it is in but those of `keep`; returns once the memory
        it was charged for is back in the OS."""
        while True:
            pack = next(
                (p for p in self._packs.values() if model.model_id in p.members and p.worker not in keep),
                None,
            )
            if pack is None:
                return
            async with pack.lock:
                if model.model_id in pack.members and pack in self._packs.values():
                    await self._take_out(pack, model)
                else:
                    pack.members.pop(model.model_id, None)

    async def _take_out(self, pack: Pack, model: Model) -> None:
        """Holding the pack's lock: drop the model, and recycle the pack if it did not shrink enough."""
        model_id = model.model_id
        del pack.members[model_id]
        charged = pack.charged.pop(model_id, None)
        pack.growth_charged.pop(model_id, None)
        grown = pack.grown.pop(model_id, 0)
        if not pack.charged and not pack.members:
            await self._end(pack, f"its last model ({model_id}) is unloaded")
            return
        if pack.abandoned:  # a load given up may still run in the pack
            await self._recycle(pack, f"the load of {model_id} was abandoned")
            return
        if charged is None:  # its load was never sent, or failed and was cleaned up then
            return
        worker = pack.worker
        before = memory.anonymous(worker.pid)
        try:
            await self.pool.send_drop(worker, model_id)
        except PeerGone:
            return  # the pack died: its memory is back once reaped, and the supervisor heals the rest
        freed = before - memory.anonymous(worker.pid)
        if freed + RECYCLE_SLACK_BYTES < grown:
            await self._recycle(pack, f"dropping {model_id} gave back {freed} of the {grown} bytes it added")

    async def _end(self, pack: Pack, reason: str) -> None:
        """Kills a pack that holds nothing any more; returns once it is reaped."""
        pack.open = False
        self._packs.pop(pack.worker, None)
        self.pool.kill(pack.worker, KillCause.UNLOAD, reason)
        await asyncio.shield(pack.worker.exited)

    async def _recycle(self, pack: Pack, reason: str) -> None:
        """Holding the pack's lock: a fresh pack loads the survivors, the old one goes."""
        started = time.monotonic()
        old = pack.worker
        pack.open = False
        survivors = [
            m
            for model_id, m in pack.members.items()
            if model_id in pack.charged and m.ready and old in m.workers
        ]
        log.info("recycling %r: %s; %d models move", old, reason, len(survivors))
        moved = await self._move(survivors, pack) if survivors else 0
        await self._drain(old)
        self._packs.pop(old, None)
        pack.members.clear()
        self.pool.kill(old, KillCause.RECYCLED, reason)
        await asyncio.shield(old.exited)
        if self._on_recycle is not None:
            self._on_recycle(time.monotonic() - started, moved)

    async def _move(self, survivors: list[Model], old_pack: Pack) -> int:
        """Loads the survivors into a fresh pack and moves their calls to it; how many moved.

        One that does not move stays with the old pack and heals once it is killed.
        """
        try:
            worker = await self.pool.take(old_pack.format_name)
        except status.RpcError as error:
            log.error("cannot recycle into a fresh pack (%s); its models heal instead", error.message)
            return 0
        fresh = Pack(worker, old_pack.format_name)
        fresh.open = False  # takes no other model before the survivors are in
        self._packs[worker] = fresh
        moved = 0
        try:
            async with fresh.lock:
                for model in survivors:
                    fresh.members[model.model_id] = model
                    reply, _ = await self._load_into(fresh, model)
                    # One unloaded meanwhile stays a member: its unload, waiting its turn, drops it.
                    if reply["ok"] and worker.serving and model.ready:
                        _switch(model, old_pack.worker, worker)
                        moved += 1
        except PeerGone:
            log.error("the fresh pack %r died while the survivors moved in", worker)
        finally:
            fresh.open = worker.serving
            self.pool.replenish()
        return moved

    async def _drain(self, worker: Worker) -> None:
        """Waits until the worker has answered every call sent to it (or DRAIN_SECONDS passed)."""
        deadline = time.monotonic() + DRAIN_SECONDS
        while worker.in_flight and worker.serving and time.monotonic() < deadline:
            await asyncio.sleep(0.005)

    def forget(self, worker: Worker) -> list[Model]:
        """A pack's process is gone: no model goes there any more. Its models (to heal)."""
        pack = self._packs.pop(worker, None)
        if pack is None:
            return []
        pack.open = False
        models = list(pack.members.values())
        pack.members.clear()
        pack.charged.clear()
        pack.growth_charged.clear()
        return models


def _switch(model: Model, old: Worker, new: Worker) -> None:
    """The model's calls go to `new` from now on; those sent to `old` finish there."""
    if old in model.workers:
        model.workers.remove(old)
    model.workers.append(new)
    model.replicas.add(new)
    model.replicas.remove(old)


def blamed(models: list[Model], worker: Worker) -> list[Model]:
    """The models a pack's death counts against: those with calls in it, else all of them."""
    running = [m for m in models if m.model_id in worker.running]
    return running or models
