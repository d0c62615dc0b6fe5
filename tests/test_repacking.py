"""Compaction beside a heal (runtime/repacking.py), in-process with stand-in workers: no process runs,
so the order of the steps is the test's to set."""

from __future__ import annotations

import asyncio
import collections
import types

from runtime import memory, packs
from runtime.model import ModelState
from runtime.replicas import ReplicaSet
from runtime.settings import Settings
from runtime.worker import WorkerState


class StandInWorker:
    def __init__(self, name: str):
        self.name, self.pid, self.packed = name, 4000 + len(name), True
        self.state = WorkerState.SERVING
        self.models: set[str] = set()
        self.held: set[str] = set()  # what the process would hold
        self.in_flight = 0
        self.exited = asyncio.get_running_loop().create_future()

    alive = property(lambda self: self.state is not WorkerState.EXITED)
    serving = property(lambda self: self.state is WorkerState.SERVING)


class StandInPool:
    """Loads and drops as a pack would: a second load of a model it holds is refused."""

    def __init__(self):
        self.killed: list[StandInWorker] = []
        self.loading: list[str] = []  # each load sent, in order

    def spares(self):
        return []

    def replenish(self):
        pass

    async def send_load(self, worker, model_id, format_name, path, pack=False):
        self.loading.append(model_id)
        await asyncio.sleep(0.01)
        worker.models.add(model_id)
        if model_id in worker.held:
            return {"ok": False, "message": f"{model_id} is loaded already"}
        worker.held.add(model_id)
        return {"ok": True}

    async def send_drop(self, worker, model_id):
        worker.models.discard(model_id)
        worker.held.discard(model_id)
        return {"ok": True}

    def kill(self, worker, cause, reason):
        if worker.alive:
            self.killed.append(worker)
            worker.state = WorkerState.EXITED
            worker.exited.set_result(-9)


def ready_model(model_id: str):
    spec = types.SimpleNamespace(format=types.SimpleNamespace(name="python"), path=f"/m/{model_id}")
    return types.SimpleNamespace(
        model_id=model_id,
        spec=spec,
        workers=[],
        replicas=ReplicaSet(model_id, 3, 10),
        state=ModelState.READY,
        ready=True,
        called=True,
        crashes=collections.deque(),
    )


def holding(pack: packs.Pack, *models) -> None:
    for model in models:
        pack.members[model.model_id] = model
        pack.charged[model.model_id], pack.growth_charged[model.model_id] = 100, 50
        pack.worker.held.add(model.model_id)
        model.workers.append(pack.worker)
        model.replicas.add(pack.worker)


def test_a_compaction_does_not_move_a_model_into_a_pack_a_heal_is_loading_it_into(monkeypatch):
    monkeypatch.setattr(memory, "anonymous", lambda pid: 0)
    monkeypatch.setattr(memory, "cost_or_zero", lambda pid: 1000)

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


def test_a_compaction_that_waited_for_its_target_moves_nothing_into_it_once_it_is_full(monkeypatch):
    monkeypatch.setattr(memory, "anonymous", lambda pid: 0)
    monkeypatch.setattr(memory, "cost_or_zero", lambda pid: 1000)

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


async def until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.001)
