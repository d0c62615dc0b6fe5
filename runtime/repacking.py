"""Moving packed models from one pack to others: recycling a pack, and compacting packs.

A pack is recycled when it did not give back what a drop should have, or may
still run a load that was given up: a fresh spare loads its other models. A
format's packs are compacted when the places unloads left in them would hold
every model of the emptiest one: those models move there. A place left
empty is base that no model's size covers (runtime/packs.py), so compacting
keeps that below one pack's base per format, which capacity holds back. A
pack holding no model whose load ran long (Model.loads_slowly) is emptied
first: such a load would hold its new pack's calls as long.

Either way each model is loaded into its new pack with the size it was charged (model-mesh keeps
the one loadModel answered) and its calls move there: in a recycle, all at once when every
survivor is in, so that no call waits behind a load in the fresh pack while the old one is idle.
Calls already sent finish in the old pack, which is killed once it has answered them (or
DRAIN_SECONDS passed), and reaped, before the unload that set it off returns. A model that does
not move stays with the old pack and heals once it is killed. A pack that dies while its models
move out loses them to healing, which waits for the move: a model the move has given back its
replica by then heals no further.

A move, once begun, runs to its end even if the task that began it is cancelled (a load given
up, a heal stopped by an unload): cut short, it would leave a fresh pack half made, holding
models no size covered, beside an old pack that was closed but never killed. The cancelled task
waits for the move and is cancelled after it, so the pack's lock is not given up halfway either;
so LOADTIME_TIMEOUT ends a load whose failure set a recycle off only once the recycle is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from runtime import memory, status
from runtime.channel import PeerGone
from runtime.model import Model
from runtime.pack import MOVING_STATES, moves_with, switch
from runtime.tasks import to_the_end
from runtime.worker import KillCause, drain
from workers import formats

if TYPE_CHECKING:
    from runtime.pack import Pack
    from runtime.packs import Packs

log = logging.getLogger("mesh.packs")

# Loads sent ahead to a pack that loads on its main thread (custom models, which give way
# meanwhile; any model where WORKER_THREADS > 1): the next one waits queued behind the one running,
# so the pack does not idle for a round trip of the front's between loads; more would only make a
# longer burst of loading for the calls going on to get through.
LOADS_AHEAD_ON_MAIN_THREAD = 2

# By model id, what each model moving is charged in the pack it leaves: (size, growth, load added).
Charges = dict[str, tuple[int, int, int]]


class Repacker:
    def __init__(self, packs: Packs):
        self.packs = packs
        self._compacting: set[str] = set()  # formats whose emptiest pack is moving into the others
        self._moves: dict[str, list[asyncio.Future]] = {}  # model id -> each of its moves, done at its end

    async def move_ended(self, model: Model) -> None:
        """Returns once no move of the model is under way."""
        for end in list(self._moves.get(model.model_id, ())):
            await asyncio.shield(end)

    @contextlib.contextmanager
    def _moving(self, models: list[Model]) -> Iterator[None]:
        """Marks the models' moves under way while the block runs (move_ended() waits for them)."""
        loop = asyncio.get_running_loop()
        ends = [(m.model_id, loop.create_future()) for m in models]
        for model_id, end in ends:
            self._moves.setdefault(model_id, []).append(end)
        try:
            yield
        finally:
            for model_id, end in ends:
                self._moves[model_id].remove(end)
                if not self._moves[model_id]:
                    del self._moves[model_id]
                end.set_result(None)

    async def recycle(self, pack: Pack, reason: str) -> None:
        """Holding the pack's lock: a fresh pack loads the survivors, the old one goes (to the end,
        even if the caller is cancelled)."""
        await to_the_end(self._recycle(pack, reason))

    async def _recycle(self, pack: Pack, reason: str) -> None:
        started = time.monotonic()
        pack.open = False
        survivors = [m for m in pack.members.values() if moves_with(pack, m)]
        log.info("recycling %r: %s; %d models move", pack.worker, reason, len(survivors))
        moved = await self.into_fresh_pack(pack, survivors, "its models heal instead")
        await self._end(pack, reason, started, len(moved))

    async def into_fresh_pack(self, pack: Pack, models: list[Model], otherwise: str) -> list[Model]:
        """Holding the pack's lock: `models`, loaded there, load into a fresh pack with their charges,
        and their calls move to it; those that moved. `otherwise` is logged where they cannot."""
        if not models:
            return []
        charges = _charges(pack, models)  # as they are now: a pack that dies forgets them
        with self._moving(models):
            return await self._into_fresh_pack(models, pack, charges, otherwise)

    async def compact(self, format_name: str) -> bool:
        """Moves the models of one of the format's emptiest packs into the others once their free
        places hold them all, and ends it; whether it did."""
        if format_name in self._compacting:
            return False
        packs = [
            p
            for p in self.packs.of_format(format_name)
            if p.open and p.worker.serving and not p.lock.locked()
        ]
        emptiest = self._to_empty(packs)
        if emptiest is None:
            return False
        others = [p for p in packs if p is not emptiest]
        self._compacting.add(format_name)
        try:
            async with emptiest.lock:
                if emptiest.open and emptiest.worker.serving:
                    return await to_the_end(self._into_others(emptiest, others)) > 0
                return False
        finally:
            self._compacting.discard(format_name)

    def _to_empty(self, packs: list[Pack]) -> Pack | None:
        """The pack to empty into the others (None: none fits): the emptiest holding no model whose
        load ran long (it would hold its new pack's calls as long), else the emptiest of all."""
        if len(packs) < 2:
            return None
        by_size = sorted(packs, key=lambda p: len(p.members))
        quick = [p for p in by_size if not any(m.loads_slowly for m in p.members.values())]
        for candidate in (*quick[:1], *by_size[:1]):
            if self._places_for_all(candidate, [p for p in packs if p is not candidate]):
                return candidate
        return None

    def _places_for_all(self, emptiest: Pack, others: list[Pack]) -> bool:
        """Whether `others` have a free place for every model of `emptiest`, none of them beside a
        replica of itself: else the models left behind would heal when it ends, and the next
        compaction end their new pack again."""
        free = {id(p): self.packs.settings.models_per_worker - len(p.members) for p in others}
        for model in emptiest.members.values():
            fits = [p for p in others if free[id(p)] > 0 and _may_take(p, model)]
            if not fits:
                return False
            free[id(max(fits, key=lambda p: len(p.members)))] -= 1
        return True

    async def _into_fresh_pack(
        self, survivors: list[Model], old_pack: Pack, charges: Charges, otherwise: str
    ) -> list[Model]:
        """Loads the survivors into a fresh pack and moves their calls to it; those that moved.
        `otherwise` is logged where they cannot: what becomes of them.

        No spare is forked meanwhile (on two cores a fork slows the survivors' calls): the old
        pack's reap refills the spares."""
        try:
            worker = await self.packs.pool.take(old_pack.format_name)
        except status.RpcError as error:
            log.error("cannot move models into a fresh pack (%s); %s", error.message, otherwise)
            return []
        fresh = self.packs.new_pack(worker, old_pack.format_name)
        fresh.calls_bytes = old_pack.calls_bytes
        fresh.open = False  # takes no other model before the survivors are in
        loaded: list[Model] = []
        try:
            async with fresh.lock:
                try:
                    loaded = await self._load_all_moved(survivors, old_pack, fresh, charges)
                except TimeoutError:  # a load given up (_load_within): the pack may still run it
                    loaded = []
                if not loaded:
                    await self._abandon(fresh, "the survivors did not load in it in time", otherwise)
                    return []
                # Its base is what its models' growth does not cover: measured once, not per model.
                measured = await asyncio.to_thread(memory.cost_or_zero, worker.pid)
                fresh.base_bytes = measured + memory.FRONT_SHARE_BYTES - sum(fresh.growth_charged.values())
        except PeerGone:
            if worker.alive:
                await self._abandon(fresh, "it stopped taking loads while the survivors moved in", otherwise)
                return []
            log.error("the fresh pack %r died while the survivors moved in", worker)
        finally:
            fresh.open = worker.serving
        moved = self._switch_all(loaded, old_pack, fresh)
        # Loaded there but not switched (the fresh pack died meanwhile): charged where they are served.
        _move_charges(
            charges, fresh, old_pack, [m for m in loaded if m not in moved and m.state in MOVING_STATES]
        )
        return moved

    async def _abandon(self, fresh: Pack, reason: str, otherwise: str) -> None:
        """Ends a fresh pack the survivors cannot move into (`otherwise`: what becomes of them)."""
        log.error("cannot move models into %r: %s; %s", fresh.worker, reason, otherwise)
        self.packs.retire(fresh)
        self.packs.pool.kill(fresh.worker, KillCause.RECYCLED, reason)
        await asyncio.shield(fresh.worker.exited)

    async def _into_others(self, emptiest: Pack, others: list[Pack]) -> int:
        """Holding the emptiest pack's lock: its models move into the others, and it ends; how many
        moved."""
        started = time.monotonic()
        emptiest.open = False
        movers = [m for m in emptiest.members.values() if moves_with(emptiest, m)]
        charges = _charges(emptiest, movers)  # as they are now: a pack that dies forgets them
        moved = 0
        with self._moving(movers):
            for model in movers:
                moved += await self._into_other(model, emptiest, others, charges)
        reason = f"compacted: {moved} of its {len(movers)} models moved into other packs"
        log.info("%r %s", emptiest.worker, reason)
        await self._end(emptiest, reason, started, moved)
        return moved

    async def _into_other(self, model: Model, emptiest: Pack, others: list[Pack], charges: Charges) -> int:
        """Moves one model of `emptiest` into the fullest of `others` with room; 1 if it moved."""
        target = self._room_for(model, others)
        if target is None or model.state not in MOVING_STATES:  # unloaded meanwhile: it stays to go
            return 0
        try:
            async with target.lock:  # a heal may have placed the model there meanwhile: look again
                room = len(target.members) < self.packs.settings.models_per_worker
                if room and target.open and target.worker.serving and _may_take(target, model):
                    if await self._load_moved(model, emptiest, target, charges):
                        return len(self._switch_all([model], emptiest, target))
        except PeerGone:
            log.error("pack %r died while %s moved in", target.worker, model.model_id)
        except TimeoutError:  # the target still runs the load (given up: send_load()), its models wait
            self._not_moved(model, target, {"message": "its load ran past LOADTIME_TIMEOUT"})
            async with target.lock:
                await self.recycle(
                    target, f"the load of {model.model_id}, moving in, ran past LOADTIME_TIMEOUT"
                )
        return 0

    def _room_for(self, model: Model, others: list[Pack]) -> Pack | None:
        """The fullest of `others` with a free place and no replica of the model."""
        room = self.packs.settings.models_per_worker
        fits = [p for p in others if p.open and len(p.members) < room and _may_take(p, model)]
        return max(fits, key=lambda p: len(p.members), default=None)

    async def _load_moved(self, model: Model, source: Pack, target: Pack, charges: Charges) -> bool:
        """Holding the target's lock: loads a model of `source` into `target` with the size it
        was charged; whether it loaded. Its calls still go to `source` (_switch_all). One
        unloaded meanwhile stays a member: its unload, waiting its turn, drops it."""
        model_id = model.model_id
        target.members[model_id] = model
        before = memory.anonymous(target.worker.pid)
        reply = await self._load_within(target, model)
        if not reply["ok"]:
            self._not_moved(model, target, reply)
            return False
        _move_charges(charges, source, target, [model])
        target.grown[model_id] = max(0, memory.anonymous(target.worker.pid) - before)
        return True

    async def _load_all_moved(
        self, models: list[Model], source: Pack, target: Pack, charges: Charges
    ) -> list[Model]:
        """Holding the target's lock: loads `models` of `source` into `target`, with the sizes they
        were charged; those that loaded. Their calls still go to `source` (_switch_all).

        The first load into a spare goes alone (it makes the spare a pack). Where the pack loads at
        idle priority (workers/holding.py), the others are all sent at once, so the pack loads them
        back to back while the calls going on preempt it; else it loads on its main thread, and
        LOADS_AHEAD_ON_MAIN_THREAD of them are sent at a time. Either way the front reads the
        pack's memory once, not per model. Each model's drop is later checked against what it
        added in `source`, scaled down if `target` grew by less in all: what `target` grew by also
        holds what its first load wrote for all (imports, first-use caches), which no drop gives
        back, so it is not shared among them; it is in the pack's base, measured once they are in."""
        for model in models:
            target.members[model.model_id] = model
        before = memory.anonymous(target.worker.pid)
        replies: list = []
        at_once = formats.pack_loads_at_idle_priority(
            models[0].spec.format, self.packs.settings.worker_threads
        )
        for model in models:
            if target.worker.serving:  # a spare becomes a pack by its first load, alone
                break
            replies.append(reply := await self._load_within(target, model))
            if not reply["ok"] and not target.worker.serving:
                self._not_moved(model, target, reply)
                return []  # a spare whose first load failed takes no other
        queued = asyncio.Semaphore(len(models) if at_once else LOADS_AHEAD_ON_MAIN_THREAD)
        loads: list[asyncio.Future] = []  # the pack runs them one after another, in this order

        async def load(model: Model, after: asyncio.Future | None) -> dict:
            async with queued:
                return await self._load_within(target, model, after)

        for model in models[len(replies) :]:
            loads.append(asyncio.ensure_future(load(model, loads[-1] if loads else None)))
        replies += await asyncio.gather(*loads, return_exceptions=True)
        grown = max(0, memory.anonymous(target.worker.pid) - before)
        failures = [reply for reply in replies if isinstance(reply, BaseException)]
        if failures:
            raise failures[0]  # PeerGone (the target stopped taking loads), or a load given up
        loaded = []
        for model, reply in zip(models, replies, strict=True):
            assert isinstance(reply, dict)
            if reply["ok"]:
                loaded.append(model)
            else:
                self._not_moved(model, target, reply)
        _move_charges(charges, source, target, loaded)
        total_added = sum(target.grown[m.model_id] for m in loaded)
        # What each added in `source` (less than 0 for one that reused heap there), never more in
        # all than `target` grew by. Not a share of that growth: it also holds what a fresh pack's
        # first load writes for all, which no model's drop gives back (its base, measured after).
        scale = grown / total_added if total_added > grown else 1.0
        for model in loaded:
            target.grown[model.model_id] = int(target.grown[model.model_id] * scale)
        return loaded

    async def _load_within(self, pack: Pack, model: Model, after: asyncio.Future | None = None) -> dict:
        """send_load(), given up (TimeoutError) past LOADTIME_TIMEOUT from when the pack begins it,
        once the load `after` is in: a model whose load cannot end while its old copy lives (a lock
        that copy holds) must not hold the move for ever. After a load given up, at once."""
        sent = asyncio.ensure_future(self.packs.send_load(pack, model))
        try:
            if after is not None:
                await asyncio.wait([after, sent], return_when=asyncio.FIRST_COMPLETED)
                if after.done() and not after.cancelled() and isinstance(after.exception(), TimeoutError):
                    raise TimeoutError  # the pack may still run that load: this one would wait it out
            async with asyncio.timeout(self.packs.settings.loadtime_timeout / 1000):
                return await sent
        finally:
            sent.cancel()  # nothing once it is done

    @staticmethod
    def _not_moved(model: Model, target: Pack, reply: dict) -> None:
        """A model that did not load in `target`: it stays with its old pack, and heals once that goes."""
        target.members.pop(model.model_id, None)
        target.worker.models.discard(model.model_id)
        message = reply.get("message")
        log.error("%s did not load in %r (%s): it stays where it was", model.model_id, target.worker, message)

    @staticmethod
    def _switch_all(models: list[Model], source: Pack, target: Pack) -> list[Model]:
        """Moves the calls of `models`, loaded in `target`, there; those that moved. Calls go on to
        `source` until all of them are loaded: `target` answers none while it loads. Where `source`
        died meanwhile, the move gives its models back the replica its death took."""
        moved = [m for m in models if target.worker.serving and m.state in MOVING_STATES]
        for model in moved:
            switch(model, source.worker, target.worker)
        return moved

    async def _end(self, pack: Pack, reason: str, started: float, moved: int) -> None:
        """Once its calls are answered, kills a pack whose models moved out, and waits until it is
        reaped."""
        # Owed: the calls of its models that it has begun; those it has not are sent again where their
        # models moved once it is killed (runtime/dispatch.py), not kept behind one that never ends.
        # The unloaded model's are owed nothing. A model that did not move takes no new call here
        # (they wait for its heal): ever new calls would hold the pack, and the unload, DRAIN_SECONDS.
        for model in pack.members.values():
            model.replicas.remove(pack.worker)
        members, channel = set(pack.members), self.packs.pool.channel
        await drain(pack.worker, lambda: channel.owes_begun(pack.worker.identity, members))
        pack.open = False
        # Those whose calls still go to it did not move: they stay its members, and heal once
        # it is reaped (Healer.on_worker_exit asks Packs.forget for them).
        pack.members = {i: m for i, m in pack.members.items() if pack.worker in m.workers}
        if not pack.members:
            self.packs.retire(pack)
        self.packs.pool.kill(pack.worker, KillCause.RECYCLED, reason)
        await asyncio.shield(pack.worker.exited)
        if self.packs.on_recycle is not None:
            self.packs.on_recycle(time.monotonic() - started, moved)


def _may_take(pack: Pack, model: Model) -> bool:
    """Whether a model may move into `pack`: neither a replica of it nor a load of it (a heal's) is there."""
    return pack.worker not in model.workers and model.model_id not in pack.members


def _charges(pack: Pack, models: list[Model]) -> Charges:
    """What each of `models` is charged in `pack`."""
    ids = [m.model_id for m in models]
    return {i: (pack.charged.get(i, 0), pack.growth_charged.get(i, 0), pack.grown.get(i, 0)) for i in ids}


def _move_charges(charges: Charges, source: Pack, target: Pack, models: list[Model]) -> None:
    """The models' charges, as they were in `source` when their move began, are `target`'s now."""
    for model in models:
        model_id = model.model_id
        target.charged[model_id], target.growth_charged[model_id], target.grown[model_id] = charges[model_id]
        for charged in (source.charged, source.growth_charged, source.grown):
            charged.pop(model_id, None)
