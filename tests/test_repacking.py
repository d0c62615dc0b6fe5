"""Compaction beside a heal (runtime/repacking.py), in-process with stand-in workers: no process runs,
so the order of the steps is the test's to set."""

from __future__ import annotations

import asyncio
import types

import pytest
from standins import StandInPool, StandInWorker, holding, ready_model, until

from runtime import memory, packs, worker
from runtime.healing import Healer
from runtime.settings import Settings
from runtime.worker import WorkerState


@pytest.fixture(autouse=True)
def memory_of_stand_ins(monkeypatch):
    monkeypatch.setattr(memory, "anonymous", lambda pid: 0)
    monkeypatch.setattr(memory, "cost_or_zero", lambda pid: 1000)


def test_a_compaction_does_not_move_a_model_into_a_pack_a_heal_is_loading_it_into():

    async def scenario():
        settings = Settings.from_env({"MODELS_PER_WORKER": "4", "MODEL_REPLICAS": "2"})
        pool = StandInPool()
        pack_set = packs.Packs(settings, pool)
        emptiest = pack_set.new_pack(StandInWorker("E"), "python")
        target = pack_set.new_pack(StandInWorker("T"), "python")
        emptiest.base_bytes = target.base_bytes = 1
        healed, first, second = ready_model("healed"), ready_model("t1"), ready_model("t2")
        holding(emptiest, healed)  # its other replica was in a pack that died
        holding(target, first, second)
        await target.lock.acquire()  # an unload of t2 drops it
        heal = asyncio.create_task(pack_set.load(healed, avoid=healed.workers))  # as healing does
        await asyncio.sleep(0)
        assert "healed" in target.members  # placed, waiting for the lock
        for charged in (target.members, target.charged, target.growth_charged):
            del charged["t2"]
        target.worker.held.discard("t2")
        target.lock.release()  # then the unload compacts, before the heal has the lock
        await pack_set.compact_all("python")
        await heal
        after_compaction = {
            "killed": list(pool.killed),
            "emptiest charged": sorted(emptiest.charged),
            "target members": sorted(target.members),
            "target charged": sorted(target.charged),
        }
        for model in (healed, first):  # unloadModel of each
            await pack_set.remove(model)
        return after_compaction, pool, target

    after_compaction, pool, target = asyncio.run(scenario())
    # Nothing moved (no place for it but where the heal loads it), and the heal's load is kept.
    assert after_compaction == {
        "killed": [],
        "emptiest charged": ["healed"],
        "target members": ["healed", "t1"],
        "target charged": ["healed", "t1"],
    }
    # Unloading "healed" dropped it from the pack; unloading the pack's last model ended it.
    assert "healed" not in target.worker.held and target.worker in pool.killed


def test_a_compaction_that_waited_for_its_target_moves_nothing_into_it_once_it_is_full():

    async def scenario():
        pool = StandInPool()
        pack_set = packs.Packs(Settings.from_env({"MODELS_PER_WORKER": "6"}), pool)
        emptiest = pack_set.new_pack(StandInWorker("E"), "python")
        target = pack_set.new_pack(StandInWorker("T"), "python")
        emptiest.base_bytes = target.base_bytes = 1
        holding(emptiest, ready_model("m1"), ready_model("m2"))
        holding(target, *(ready_model(f"t{i}") for i in range(3)))
        compaction = asyncio.create_task(pack_set.compact_all("python"))
        await until(lambda: "m1" in pool.loading)  # m1 moves into the target's fourth place
        loads = [asyncio.create_task(pack_set.load(ready_model("a"), avoid=[]))]  # the fifth, after m1
        # Once "a" loads, the compaction has found the sixth place free for m2 and waits its turn.
        await until(lambda: "a" in pool.loading)
        loads.append(asyncio.create_task(pack_set.load(ready_model("b"), avoid=[])))  # the sixth
        await asyncio.gather(compaction, *loads)
        return sorted(target.members)

    assert asyncio.run(scenario()) == ["a", "b", "m1", "t0", "t1", "t2"]  # six places, m2 not in


def test_a_recycle_keeps_the_charges_of_models_whose_old_pack_dies_before_they_move():
    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        pool = StandInPool(fresh)
        pack_set = packs.Packs(Settings.from_env({"MODELS_PER_WORKER": "4"}), pool)
        old = pack_set.new_pack(StandInWorker("O"), "python")
        old.base_bytes = 1
        holding(old, ready_model("a"), ready_model("b"))
        async with old.lock:
            recycle = asyncio.create_task(pack_set.repacker.recycle(old, "a test"))
            await until(lambda: pool.takes)  # it waits for a spare to take
            pack_set.forget(old.worker)  # the old pack died: what the reaper does to the packs
            old.worker.state = WorkerState.EXITED
            old.worker.exited.set_result(-9)
            await recycle
        return pack_set.of(fresh)

    fresh_pack = asyncio.run(scenario())
    assert fresh_pack.charged == {"a": 100, "b": 100}
    assert fresh_pack.growth_charged == {"a": 50, "b": 50}


def test_a_failed_heal_does_not_drop_its_model_from_the_pack_a_move_has_just_put_it_in():
    async def scenario():
        settings = Settings.from_env({"MODELS_PER_WORKER": "4", "MODEL_REPLICAS": "2"})
        fresh = StandInWorker("F", WorkerState.SPARE)
        fresh.load_seconds = 0.2
        pool = StandInPool(fresh)
        pack_set = packs.Packs(settings, pool)
        recycled = pack_set.new_pack(StandInWorker("R"), "python")
        refusing = pack_set.new_pack(StandInWorker("X"), "python")  # where the heal goes, and fails
        recycled.base_bytes = refusing.base_bytes = 1
        healed, other = ready_model("m"), ready_model("n")
        holding(recycled, healed, other)  # m's other replica died: it heals
        holding(refusing, ready_model("x"))
        refusing.worker.refuses_loads = True
        supervisor = types.SimpleNamespace(
            settings=settings, metrics=None, pool=pool, packs=pack_set, discard=lambda model: None
        )
        async with recycled.lock:  # a neighbour's unload recycles the pack
            recycle = asyncio.create_task(pack_set.repacker.recycle(recycled, "a test"))
            await until(lambda: "m" in pool.loading)  # m loads in the fresh pack
            heal = asyncio.create_task(Healer(supervisor)._reload_into_a_pack(healed))
            await recycle
        await heal
        return healed, fresh

    healed, fresh = asyncio.run(scenario())
    assert healed.workers == [fresh] and "m" in fresh.held  # its calls go where it is loaded


def test_an_unload_whose_calls_run_past_the_grace_recycles_the_pack_instead_of_waiting_for_them(monkeypatch):
    monkeypatch.setattr(packs, "CALLS_GRACE_SECONDS", 0.05)
    monkeypatch.setattr(worker, "DRAIN_SECONDS", 0.05)

    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        pool = StandInPool(fresh)
        pack_set = packs.Packs(Settings.from_env({"MODELS_PER_WORKER": "4", "WORKER_THREADS": "2"}), pool)
        old = pack_set.new_pack(StandInWorker("O"), "python")
        old.base_bytes = 1
        stuck, other = ready_model("stuck"), ready_model("other")
        holding(old, stuck, other)
        old.worker.calls["stuck"] = old.worker.in_flight = 1  # a call that never returns
        await asyncio.wait_for(pack_set.remove(stuck), 5)
        return pool, old.worker, fresh, other

    pool, old_worker, fresh, other = asyncio.run(scenario())
    assert pool.killed == [old_worker] and other.workers == [fresh] and fresh.held == {"other"}


def test_a_compaction_empties_a_pack_holding_a_model_whose_load_ran_long_only_if_no_other_fits():

    async def scenario(slow_where: str):
        pool = StandInPool()
        pack_set = packs.Packs(Settings.from_env({"MODELS_PER_WORKER": "4"}), pool)
        lone = pack_set.new_pack(StandInWorker("L"), "python")
        fuller = pack_set.new_pack(StandInWorker("F"), "python")
        lone.base_bytes = fuller.base_bytes = 1
        alone, f1, f2 = ready_model("alone"), ready_model("f1"), ready_model("f2")
        holding(lone, alone)
        holding(fuller, f1, f2)
        for where in slow_where.split("+"):
            {"lone": alone, "fuller": f1}[where].loads_slowly = True
        await pack_set.compact_all("python")
        return sorted(lone.members), sorted(fuller.members), list(pool.loading), pool.killed, lone, fuller

    # The emptiest pack holds it: loaded beside f1 and f2, its load would hold their calls. They
    # move in beside it instead, and it never loads again.
    lone_members, fuller_members, loading, killed, _, fuller = asyncio.run(scenario("lone"))
    assert lone_members == ["alone", "f1", "f2"] and fuller_members == []
    assert loading == ["f1", "f2"] and killed == [fuller.worker]
    # The fuller one holds it: "alone" loads quickly, and moves in beside it as usual.
    lone_members, fuller_members, loading, killed, lone, _ = asyncio.run(scenario("fuller"))
    assert fuller_members == ["alone", "f1", "f2"] and loading == ["alone"] and killed == [lone.worker]
    # Both do: the emptiest moves all the same, or packs of a model or two would pile up, their bases
    # covered by no size.
    lone_members, fuller_members, loading, killed, lone, _ = asyncio.run(scenario("lone+fuller"))
    assert fuller_members == ["alone", "f1", "f2"] and loading == ["alone"] and killed == [lone.worker]


def test_a_recycle_ends_its_pack_without_waiting_on_new_calls_of_a_model_that_did_not_move():
    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        fresh.refused = {"stays"}  # it cannot load in the fresh pack: it stays, and heals
        pool = StandInPool(fresh)
        pack_set = packs.Packs(Settings.from_env({"MODELS_PER_WORKER": "4"}), pool)
        old = pack_set.new_pack(StandInWorker("O"), "python")
        old.base_bytes = 1
        moves, stays = ready_model("moves"), ready_model("stays")
        holding(old, moves, stays)
        offered = []  # whether the old pack could still take a call of "stays", each time one ended

        async def steady_calls() -> None:  # one ends and the next comes, while the old pack takes them
            while old.worker.alive:
                offered.append(old.worker in stays.replicas.workers)
                old.worker.calls["stays"] = old.worker.in_flight = int(offered[-1])
                await asyncio.sleep(0.01)

        calls = asyncio.create_task(steady_calls())
        await until(lambda: offered)
        async with old.lock:
            await asyncio.wait_for(pack_set.repacker.recycle(old, "a test"), worker.DRAIN_SECONDS / 2)
        await calls
        return pool, old, fresh, moves, stays, offered

    pool, old, fresh, moves, stays, offered = asyncio.run(scenario())
    assert pool.killed == [old.worker] and moves.workers == [fresh]
    assert list(old.members) == ["stays"] and stays.workers == [old.worker], (
        "it heals once the pack is reaped"
    )
    assert not offered[-1], "its calls wait for the heal rather than go to the pack being ended"
