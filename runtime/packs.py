"""Packs: worker processes that each hold several small models.

With MODELS_PER_WORKER > 1 (the default), a model whose predicted size without its format's floor
(bytes on disk x MODELSIZE_MULTIPLIER) is below MODEL_PACK_MAX_BYTES goes into the fullest pack of
its format that has room, or into a spare that becomes a new pack. Each replica goes into another
pack. A load does not queue behind another: while every pack with room is loading, a spare becomes
another pack, up to FILLING_PACKS_MAX packs of a format with room. Nor does it go to a pack whose
last model waits for its first call while another has room: model-mesh sends that call the moment
loadModel returns, and a load sent before it would hold it up.

Every load into a pack and every drop from it runs alone (the pack's lock). A load that runs long
beside other models has them moved to a fresh pack meanwhile, and the pack is left to it
(runtime/slowloads.py). A new pack loads its first model twice, the first time dropped at once,
and its base is what it costs then, measured from outside with the kernel's share
(runtime/memory.py): the spare, and what a first load writes that later loads reuse. A model's
size is what the pack grew by that no model is charged for yet (its load, and what calls since the
last load added; at least PACKED_MODEL_MIN_BYTES), its share of the base (over MODELS_PER_WORKER),
DROP_LEFTOVER_BYTES for what later drops may leave, and what the front holds for it: model-mesh
reads capacity only once, at start, so a pack's base must be in the sizes of the models that fill
it. What a pack costs beyond its models' sizes (one not yet full) is counted in capacity
(`unclaimed()`, and the supervisor's hold-back for open packs).

What a load added and what a drop gave back are read from the pack's anonymous pages
(memory.anonymous(), cheap). A pack whose drops and failed loads kept over RECYCLE_SLACK_BYTES in
all (what each load added less what its drop gave back) is recycled before the unload returns, and
so is one that may still run an abandoned load or a process its load started
(multiprocessing's fork server) after its drop, and one whose drop (the model's close()) runs past
CALLS_GRACE_SECONDS; after an unload, a format's emptiest pack may be compacted into the others
(runtime/repacking.py). A model whose load leaves processes running moves to a worker of its own
(runtime/supervisor.py): what it shares with them, and its neighbours' pages a child it forked
keeps, are in no measure of the pack.

A pack that dies takes only its own models down; the supervisor heals them into other packs and
counts the crash against the model whose code it was running (runtime/healing.py blamed()).
"""

from __future__ import annotations

import asyncio
import logging
import time

from plumbing import lifeline
from runtime import forkserver, memory, slowloads
from runtime.channel import PeerGone
from runtime.model import Model
from runtime.modelspec import ModelSpec
from runtime.pack import RECYCLE_SLACK_BYTES, Pack, PackedLoad
from runtime.pool import WorkerPool
from runtime.repacking import Repacker
from runtime.settings import Settings
from runtime.tasks import to_the_end
from runtime.worker import KillCause, Worker, WorkerState, calls_answered, drain
from workers import formats, protocol

log = logging.getLogger("mesh.packs")

# The least a packed model's load is charged: a load that reused heap the
# pack had freed grows it by less than the model holds. What one model is
# charged beyond its growth is credit that the next loads' growth uses up.
PACKED_MODEL_MIN_BYTES = 8 * 1024
# What each packed model is charged for drops: drops may leave up to RECYCLE_SLACK_BYTES in their
# pack (heap pages the survivors still use part of), and only a later load into that pack is
# charged it, which a compaction's moves into its free places never are. Under churn near
# capacity, packs were measured to outgrow their models' sizes (docs/density.md).
DROP_LEFTOVER_BYTES = 8 * 1024
# Charged to every packed model on top of its growth and shares.
PER_MODEL_BYTES = DROP_LEFTOVER_BYTES + memory.FRONT_MODEL_BYTES
# The least a model is predicted to add to its pack before it is loaded: above what tiny
# models were measured to add (docs/density.md), so that predictModelSize stays conservative.
PACKED_PREDICTION_MIN_BYTES = 256 * 1024
# A pack's base, predicted in floors of its format before any pack of it has measured one.
PREDICTED_BASE_PER_FLOOR = 2
# Packs of one format taking models at once: model-mesh loads two models at a time by default.
FILLING_PACKS_MAX = 2
# Models that left a pack for workers of their own, remembered (by id and path) so that their next
# load goes there at once: a pack first would run their load twice. The oldest forgotten past this.
LEFT_PACKS_MAX = 4096
# How long an unload lets the model's calls under way in its pack run, then its drop (its close()):
# as long as a worker of its own gets between SIGTERM and SIGKILL.
CALLS_GRACE_SECONDS = 2.0


class Packs:
    def __init__(self, settings: Settings, pool: WorkerPool, on_recycle=None):
        """on_recycle(seconds, models_moved) is told of every recycle and compaction (metrics)."""
        self.settings = settings
        self.pool = pool
        self._packs: dict[Worker, Pack] = {}
        self.on_recycle = on_recycle
        self.repacker = Repacker(self)
        self._left: dict[tuple[str, str], None] = {}  # LEFT_PACKS_MAX

    def accepts(self, spec: ModelSpec) -> bool:
        """Whether the model goes into a pack: a small one whose framework the fork servers preload.
        A pack's first model of another would import it there, tens of MiB of base that no size
        holds and capacity does not hold back; in a worker of its own, its size holds the import.
        Not a custom model with modules of its own (ModelSpec.brings_modules)."""
        if (
            not self.packs_format(spec.format)
            or spec.brings_modules
            or (spec.model_id, spec.path) in self._left
        ):
            return False
        estimate = spec.disk_bytes * self.settings.modelsize_multiplier
        return self.settings.models_per_worker > 1 and estimate < self.settings.model_pack_max_bytes

    def note_left(self, spec: ModelSpec) -> None:
        """The model left its pack for a worker of its own: its next load goes there at once."""
        self._left[spec.model_id, spec.path] = None
        if len(self._left) > LEFT_PACKS_MAX:
            del self._left[next(iter(self._left))]

    def packs_format(self, fmt: formats.Format) -> bool:
        """Whether models of `fmt` may go into packs: python's, and those of preloaded frameworks."""
        return fmt.framework is None or fmt.framework in self.settings.worker_preload

    def predicted_size(self, spec: ModelSpec) -> int:
        """A conservative size for one copy of a model that will go into a pack: what its load
        may add, its share of a base (the largest its format's packs measured, else
        PREDICTED_BASE_PER_FLOOR floors of the format), and the bytes charged per model."""
        format_name = spec.format.name
        bases = [p.base_bytes + p.calls_bytes for p in self.of_format(format_name)]
        base = max(bases, default=0) or spec.format.size_floor * PREDICTED_BASE_PER_FLOOR
        load = max(int(spec.disk_bytes * self.settings.modelsize_multiplier), PACKED_PREDICTION_MIN_BYTES)
        return load + base // self.settings.models_per_worker + PER_MODEL_BYTES

    def of(self, worker: Worker) -> Pack | None:
        return self._packs.get(worker)

    def of_format(self, format_name: str) -> list[Pack]:
        return [pack for pack in self._packs.values() if pack.format_name == format_name]

    def new_pack(self, worker: Worker, format_name: str) -> Pack:
        pack = self._packs[worker] = Pack(worker, format_name)
        return pack

    def retire(self, pack: Pack) -> None:
        """The pack takes no model and counts for nothing any more: it is about to be killed."""
        pack.open = False
        self._packs.pop(pack.worker, None)

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

    async def load(self, model: Model, avoid: list[Worker]) -> PackedLoad:
        """Loads the model into a pack (not one in `avoid`). Raises PeerGone if the pack dies."""
        while True:
            pack = await self._place(model, avoid)
            async with slowloads.lock_unless_left(pack) as locked:
                if locked and pack.open and model.model_id in pack.members:
                    reply, size = await self._load_into(pack, model)
                    return PackedLoad(pack.worker, reply, size, bool(pack.started.get(model.model_id)))
            pack.members.pop(model.model_id, None)  # recycled, emptied or left to a load meanwhile: again

    async def _place(self, model: Model, avoid: list[Worker]) -> Pack:
        """A pack with room for the model, its place taken at once; a spare becomes one if none has."""
        format_name = model.spec.format.name
        fits = [
            pack
            for pack in self._packs.values()
            if pack.open
            and pack.format_name == format_name
            and pack.worker.state not in (WorkerState.CONDEMNED, WorkerState.EXITED)
            and pack.worker not in avoid
            and model.model_id not in pack.members
            and len(pack.members) < self.settings.models_per_worker
        ]
        loading = all(pack.lock.locked() for pack in fits)
        if fits and not (loading and len(fits) < FILLING_PACKS_MAX and self._spare_ready(format_name)):
            # The fullest one that no load holds and no first call waits on: fewer processes in all.
            now = time.monotonic()
            pack = max(fits, key=lambda p: p.preference(now))
        else:
            pack = self.new_pack(await self.pool.take(format_name), format_name)
        pack.members[model.model_id] = model
        return pack

    def _spare_ready(self, format_name: str) -> bool:
        """An idle spare could become a pack of the format now, with no fork to wait for."""
        group = forkserver.group_for(format_name, self.settings.worker_preload)
        return any(worker.group == group for worker in self.pool.spares())

    async def _load_into(self, pack: Pack, model: Model) -> tuple[dict, int]:
        """Holding the pack's lock: load, measured from outside before and after."""
        worker = pack.worker
        rehearsed: list = []  # what the rehearsal left running (multiprocessing's fork server, say)
        if not pack.base_bytes:
            reply = await self.rehearse(pack, model)
            if not reply["ok"]:
                return await self._failed(pack, model, reply, left=0)
            rehearsed = reply.get("processes", [])
        before = memory.anonymous(worker.pid)
        reply = await slowloads.send_load_beside_others(self, pack, model)
        if reply["ok"]:
            # Charged at once: a drop must follow even if the measuring is cancelled.
            pack.charged[model.model_id] = PACKED_MODEL_MIN_BYTES
        added = memory.anonymous(worker.pid) - before
        await slowloads.drop_left_behind(self, pack)
        if not reply["ok"]:
            return await self._failed(pack, model, reply, left=added)
        pack.grown[model.model_id] = added  # may be < 0: else a drop's tally (note_left_over) drifts up
        measured, below = await asyncio.to_thread(_cost_and_processes_below, worker.pid)
        # As the pack tells them: a diff of the processes below it would blame this load for what
        # its neighbours' threads started meanwhile.
        started = {(pid, begun) for pid, begun in [*rehearsed, *reply.get("processes", ())]}
        if running := set(filter(lifeline.lives, started)):
            pack.started[model.model_id] = running
        pack.last_loaded, pack.last_loaded_at = model, time.monotonic()
        return reply, self._charge(pack, model.model_id, measured, below)

    async def rehearse(self, pack: Pack, model: Model) -> dict:
        """A new pack loads its first model once and drops it before the load that counts.

        What a pack's first load writes that later loads reuse (imports, caches,
        pages copied from the fork server) is so in the base, measured after, and
        not in the first model's size. The reply of the rehearsal load.
        """
        reply = await self.send_load(pack, model)
        if reply["ok"]:
            try:
                await asyncio.wait_for(self.pool.send_drop(pack.worker, model.model_id), CALLS_GRACE_SECONDS)
            except TimeoutError:  # its close() does not end: alone, it is killed 2 s into an unload
                pack.give_up_load(model.model_id)
                return {"ok": False, "error": protocol.ERROR_LOAD, "message": "its close() did not end"}
            cost = await asyncio.to_thread(memory.cost_or_zero, pack.worker.pid)
            pack.base_bytes = cost + memory.FRONT_SHARE_BYTES
            # What calls add after the pack's last load no later load's growth pays for.
            pack.calls_bytes = model.spec.format.first_calls_bytes
        return reply

    async def send_load(self, pack: Pack, model: Model) -> dict:
        model_id, spec = model.model_id, model.spec
        try:
            return await self.pool.send_load(pack.worker, model_id, spec.format.name, spec.path, pack=True)
        except asyncio.CancelledError:
            pack.give_up_load(model_id)  # the worker may still be loading it
            raise

    async def _failed(self, pack: Pack, model: Model, reply: dict, left: int) -> tuple[dict, int]:
        """A load the pack refused: the pack ends if it holds nothing, or is recycled if the load
        left `left` bytes behind; (the reply, 0 bytes charged)."""
        pack.members.pop(model.model_id, None)
        pack.worker.models.discard(model.model_id)
        if not pack.charged:
            await self._end(pack, f"its first load ({model.model_id}) failed")
        elif (in_all := pack.note_left_over(left)) > RECYCLE_SLACK_BYTES:
            await self.repacker.recycle(
                pack, f"the failed load of {model.model_id} left {left} of {in_all} bytes"
            )
        return reply, 0

    def _charge(self, pack: Pack, model_id: str, measured: int, processes_below: bool = False) -> int:
        """The model's size, now that the pack costs `measured`: what no model is charged for yet (at
        least PACKED_MODEL_MIN_BYTES), its share of the base and of what calls add after the
        pack's last load (its format's first_calls_bytes), what drops may leave behind
        (DROP_LEFTOVER_BYTES), and what the front holds for it.

        So the sizes of a pack's models add up to at least what it grew by, and a load that only
        refilled heap freed before is not charged that heap a second time. Where processes run
        below the pack (`processes_below`), not less than its anonymous memory grew by
        (`pack.grown`): a model that forks a child as it loads shares what it wrote with it, in
        neither one's unique pages, which `measured` counts. That part is in its size only, not
        in `growth_charged`, which later loads and a fresh pack's base subtract from `measured`.
        """
        others = sum(charge for other, charge in pack.growth_charged.items() if other != model_id)
        uncharged = measured + memory.FRONT_SHARE_BYTES - pack.base_bytes - others
        growth = max(uncharged, PACKED_MODEL_MIN_BYTES)
        shared = max(0, pack.grown.get(model_id, 0) - growth) if processes_below else 0
        # A pack left to one model's long load (runtime/slowloads.py) holds none other for good.
        sharing = self.settings.models_per_worker
        if pack.left_to is not None and pack.left_to.model_id == model_id:
            sharing = 1
        share = max(0, pack.base_bytes + pack.calls_bytes) // sharing
        size = growth + shared + share + PER_MODEL_BYTES
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
            # To its end even if the caller is cancelled (a load moving the model out, say): cut
            # short, the drop's checks would not run, and what the model left would stay.
            if await to_the_end(self._take_out_locked(pack, model, keep)):
                await self.repacker.compact(pack.format_name)

    async def _take_out_locked(self, pack: Pack, model: Model, keep: list[Worker] | tuple) -> bool:
        """remove() in one pack; whether the pack's format may be compacted after."""
        async with pack.lock:
            if pack.worker in keep:  # a move switched the model's calls there meanwhile: it stays
                return False
            if model.model_id in pack.members and pack in self._packs.values():
                await self._take_out(pack, model)
            else:
                pack.members.pop(model.model_id, None)
        return True

    async def move_ended(self, model: Model) -> None:
        """Returns once no recycle or compaction is moving the model."""
        await self.repacker.move_ended(model)

    async def compact_all(self, format_name: str) -> None:
        """Compacts the format's packs until their free places no longer hold a whole pack's models:
        after a burst of loads at once (a dead pack's models healing), each load that found every
        pack with room loading took a spare as a new pack, whose base its models do not cover."""
        while await self.repacker.compact(format_name):
            pass

    async def _take_out(self, pack: Pack, model: Model) -> None:
        """Holding the pack's lock: drop the model, and recycle the pack if it did not shrink enough."""
        model_id = model.model_id
        del pack.members[model_id]
        charged = pack.charged.pop(model_id, None)
        pack.growth_charged.pop(model_id, None)
        grown = pack.grown.pop(model_id, 0)
        started = pack.started.pop(model_id, set())
        if not pack.charged and not pack.members:  # its calls get the grace they get beside others
            await calls_answered(pack.worker, model_id, CALLS_GRACE_SECONDS)
            await self._end(pack, f"its last model ({model_id}) is unloaded", CALLS_GRACE_SECONDS, model_id)
            return
        if pack.abandoned:  # a load given up may still run in the pack
            await self.repacker.recycle(pack, f"the load of {pack.abandoned} was abandoned")
            return
        if charged is None:  # its load was never sent, or failed and was cleaned up then
            return
        worker = pack.worker
        # Its calls run beside the drop (on threads, which would close the model under them), or
        # ahead of it on the main thread, for as long as they take. A call that runs on past the
        # grace is ended with the pack, as a worker of its own is killed then.
        if not await calls_answered(worker, model_id, CALLS_GRACE_SECONDS):
            await self.repacker.recycle(pack, f"calls of {model_id} ran on past its unload")
            return
        before = memory.anonymous(worker.pid)
        try:
            await asyncio.wait_for(self.pool.send_drop(worker, model_id), CALLS_GRACE_SECONDS)
        except PeerGone:
            return  # the pack died: its memory is back once reaped, and the supervisor heals the rest
        except TimeoutError:
            await self.repacker.recycle(pack, f"the drop of {model_id} ran on past {CALLS_GRACE_SECONDS:g} s")
            return
        freed = before - memory.anonymous(worker.pid)
        if reason := _left_behind(model_id, started, freed, grown, pack.note_left_over(grown - freed)):
            await self.repacker.recycle(pack, reason)

    async def _end(self, pack: Pack, reason: str, grace: float = 0.0, unloaded: str = "") -> None:
        """Kills a pack that holds nothing any more once it answered the calls sent to it (one left to a
        load owes the moved models'; the `unloaded` model's had their grace), `grace` after SIGTERM
        (close()); returns once it is reaped."""
        self.retire(pack)
        await drain(pack.worker, lambda: any(model_id != unloaded for model_id in pack.worker.calls))
        self.pool.kill(pack.worker, KillCause.UNLOAD, reason, grace)
        await asyncio.shield(pack.worker.exited)

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
        pack.started.clear()
        return models


def _left_behind(model_id: str, started: set[lifeline.Identity], freed: int, grown: int, in_all: int) -> str:
    """Why its pack is recycled after the model's drop, if it is: processes its load started run
    on (multiprocessing's fork server), or its drops kept more than the slack in all (`in_all`)."""
    if outlived := [pid for pid, _ in filter(lifeline.lives, started)]:
        return f"processes the load of {model_id} started outlived it: {outlived}"
    if in_all > RECYCLE_SLACK_BYTES:
        return f"dropping {model_id} gave back {freed} of the {grown} bytes it added ({in_all} kept in all)"
    return ""


def _cost_and_processes_below(pid: int | None) -> tuple[int, bool]:
    """What pack `pid` costs (memory.cost_or_zero), and whether processes run below it."""
    return memory.cost_or_zero(pid), pid is not None and bool(lifeline.descendants(pid))
