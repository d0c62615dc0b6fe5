"""A load that runs long in a pack (runtime/slowloads.py), in-process with stand-in workers: the
pack's other models move out while it runs, and the pack is left to it."""

from __future__ import annotations

import asyncio
import time

import pytest
from standins import StandInPool, StandInWorker, holding, ready_model, until

from runtime import memory, packs, slowloads
from runtime.settings import Settings
from runtime.worker import WorkerState

MEASURED = 10 * 2**20  # what every stand-in pack costs, measured
BASE = 4 * 2**20


@pytest.fixture(autouse=True)
def quick_stand_ins(monkeypatch):
    monkeypatch.setattr(memory, "anonymous", lambda pid: 0)
    monkeypatch.setattr(memory, "cost_or_zero", lambda pid: MEASURED)
    monkeypatch.setattr(memory, "FRONT_SHARE_BYTES", 0)
    monkeypatch.setattr(slowloads, "SLOW_LOAD_SECONDS", 0.05)


def pack_of_two(*spares: StandInWorker, threads: int = 1):
    """Packs of 4 over a pool of `spares`, and a pack holding models a and b whose loads take 0.3 s."""
    settings = Settings.from_env({"MODELS_PER_WORKER": "4", "WORKER_THREADS": str(threads)})
    recycles: list[tuple[float, int]] = []
    pool = StandInPool(*spares)
    pack_set = packs.Packs(
        settings, pool, on_recycle=lambda seconds, moved: recycles.append((seconds, moved))
    )
    old = pack_set.new_pack(StandInWorker("O"), "python")
    old.base_bytes = BASE
    holding(old, ready_model("a"), ready_model("b"))
    old.worker.load_seconds = 0.3
    return pack_set, pool, old, recycles


def test_the_others_move_out_while_a_load_runs_long_and_the_pack_is_left_to_it():
    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        pack_set, pool, old, recycles = pack_of_two(fresh)
        slow = ready_model("slow")
        loading = asyncio.create_task(pack_set.load(slow, avoid=[]))
        await until(lambda: pack_set.of(fresh) is not None and pack_set.of(fresh).open)
        moved_while_loading = not loading.done()
        worker, reply, size, _ = await loading
        return pack_set, old, fresh, recycles, moved_while_loading, worker, reply, size

    pack_set, old, fresh, recycles, moved_while_loading, worker, reply, size = asyncio.run(scenario())
    assert moved_while_loading and worker is old.worker and reply["ok"]
    a, b = (pack_set.of(fresh).members[m] for m in ("a", "b"))
    assert a.workers == [fresh] and b.workers == [fresh]  # their calls go to the fresh pack
    assert sorted(pack_set.of(fresh).charged) == ["a", "b"]  # with what they were charged
    # The old pack dropped its copies once the load was in, holds the slow model alone, takes no other
    # model, and charges it all of its base.
    assert old.worker.held == {"slow"} and list(old.members) == ["slow"] and not old.open
    assert old.left_behind == set() and size == MEASURED + packs.PER_MODEL_BYTES
    assert [moved for _, moved in recycles] == [2]


def test_where_no_fresh_pack_can_be_had_the_others_stay_and_the_pack_takes_models_again():
    async def scenario():
        pack_set, pool, old, recycles = pack_of_two()  # no spare, as at WORKERS_MAX
        slow = ready_model("slow")
        _, reply, size, _ = await pack_set.load(slow, avoid=[])
        return old, recycles, reply, size

    old, recycles, reply, size = asyncio.run(scenario())
    assert reply["ok"] and old.open and old.left_to is None
    assert sorted(old.members) == ["a", "b", "slow"] and old.worker.held == {"a", "b", "slow"}
    # What no other model is charged, and a share of the base, as any packed model.
    others = 50 + 50
    assert recycles == [] and size == MEASURED - BASE - others + BASE // 4 + packs.PER_MODEL_BYTES


def test_a_load_given_up_on_while_the_others_move_out_lets_the_move_end_and_its_unload_ends_the_pack():
    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        fresh.load_seconds = 0.1
        pack_set, pool, old, _ = pack_of_two(fresh)
        slow = ready_model("slow")
        loading = asyncio.create_task(pack_set.load(slow, avoid=[]))
        await until(lambda: "a" in pool.loading)  # the move is under way
        loading.cancel()  # the load's unload (discard) cancels it
        with pytest.raises(asyncio.CancelledError):
            await loading
        moved = pack_set.of(fresh) is not None and sorted(pack_set.of(fresh).charged)
        await pack_set.remove(slow)
        return pool, old, fresh, moved

    pool, old, fresh, moved = asyncio.run(scenario())
    assert moved == ["a", "b"]  # the move ran to its end
    assert old.abandoned and pool.killed == [old.worker]  # the pack, maybe still loading, is ended
    assert fresh not in pool.killed and fresh.held == {"a", "b"}


def test_the_calls_sent_to_the_old_pack_are_answered_before_it_drops_the_models_that_moved():
    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        pack_set, pool, old, _ = pack_of_two(fresh, threads=2)
        old.worker.calls["a"] = old.worker.in_flight = 1  # sent before the move, waiting for the load
        dropped_at = {}
        send_drop = pool.send_drop

        async def noting_drop(worker, model_id):
            dropped_at[model_id] = time.monotonic()
            return await send_drop(worker, model_id)

        pool.send_drop = noting_drop
        loading = asyncio.create_task(pack_set.load(ready_model("slow"), avoid=[]))
        await until(lambda: "slow" in old.worker.held)  # the load is in
        await asyncio.sleep(0.05)
        answered_at = time.monotonic()
        old.worker.calls.clear()
        old.worker.in_flight = 0
        await loading
        return dropped_at, answered_at, old

    dropped_at, answered_at, old = asyncio.run(scenario())
    assert answered_at < dropped_at["a"] and "b" in dropped_at
    assert old.worker.held == {"slow"}


def test_a_load_placed_in_the_pack_before_the_move_goes_elsewhere_without_waiting_for_the_slow_load():
    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        pack_set, pool, old, _ = pack_of_two(fresh)
        slow = asyncio.create_task(pack_set.load(ready_model("slow"), avoid=[]))
        await until(lambda: "slow" in pool.loading)
        # No spare is ready and the one pack with room is loading: "next" waits for its lock.
        following = asyncio.create_task(pack_set.load(ready_model("next"), avoid=[]))
        await until(lambda: "next" in old.members)
        worker, reply, _, _ = await following
        return worker, reply, slow.done(), old, await slow

    worker, reply, slow_done, old, _ = asyncio.run(scenario())
    assert worker.name == "F" and reply["ok"] and not slow_done  # beside the models that moved
    assert "next" not in old.members and old.worker.held == {"slow"}


def test_a_load_whose_caller_is_cancelled_as_its_reply_arrives_leaves_its_pack_abandoned():
    async def scenario():
        pack_set, pool, old, _ = pack_of_two()
        old.worker.load_seconds = 0.01  # a quick load: no move
        # The model's unload lands in the same turn as the reply.
        pool.after_load = lambda worker, model_id: loading.cancel()
        quick = ready_model("quick")
        loading = asyncio.create_task(pack_set.load(quick, avoid=[]))
        with pytest.raises(asyncio.CancelledError):
            await loading
        abandoned = old.abandoned
        await pack_set.remove(quick)  # its unload: the pack holds it, charged or not
        return abandoned, pool, old

    abandoned, pool, old = asyncio.run(scenario())
    # So its unload recycled the pack (no spare here: its models heal), and "quick" went with it.
    assert abandoned and old.worker in pool.killed


def test_the_models_that_moved_out_get_their_calls_answered_when_the_slow_load_is_given_up_on():
    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        pack_set, pool, old, _ = pack_of_two(fresh)
        old.worker.load_seconds = 30  # a load that runs on till it is given up on
        slow = ready_model("slow")
        loading = asyncio.create_task(pack_set.load(slow, avoid=[]))
        await until(lambda: pack_set.of(fresh) is not None and pack_set.of(fresh).open)
        old.worker.calls["a"] = old.worker.in_flight = 1  # sent to "a" before it moved, queued there
        loading.cancel()  # the slow model's unload
        with pytest.raises(asyncio.CancelledError):
            await loading
        removing = asyncio.create_task(pack_set.remove(slow))
        await asyncio.sleep(0.05)
        killed_before_answering = old.worker in pool.killed
        old.worker.calls.clear()
        old.worker.in_flight = 0  # the pack answers it
        await removing
        return killed_before_answering, pool, old

    killed_before_answering, pool, old = asyncio.run(scenario())
    assert not killed_before_answering and old.worker in pool.killed


def test_a_model_whose_fresh_pack_died_before_its_calls_switched_stays_served_and_charged_where_it_was():
    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        pack_set, pool, old, _ = pack_of_two(fresh)

        def dying_after_the_moves(worker, model_id):
            if worker is fresh and fresh.held == {"a", "b"}:
                fresh.state = WorkerState.EXITED  # dies as the last model is in, before the switch

        pool.after_load = dying_after_the_moves
        slow = ready_model("slow")
        await pack_set.load(slow, avoid=[])
        return old, pack_set.of(fresh)

    old, fresh_pack = asyncio.run(scenario())
    a, b = old.members["a"], old.members["b"]
    assert a.workers == [old.worker] and b.workers == [old.worker]  # still served by the old pack
    assert old.worker.held == {"a", "b", "slow"} and sorted(old.charged) == ["a", "b", "slow"]
    assert old.open and old.left_to is None  # not left to the slow load: a pack as before


def test_a_pack_whose_other_models_could_not_all_move_out_stays_a_pack_that_takes_models():
    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        pack_set, pool, old, _ = pack_of_two(fresh)
        fresh.refused = {"b"}  # its files are gone
        _, _, size, _ = await pack_set.load(ready_model("slow"), avoid=[])
        return old, pack_set.of(fresh), size

    old, fresh_pack, size = asyncio.run(scenario())
    assert sorted(fresh_pack.charged) == ["a"] and sorted(old.charged) == ["b", "slow"]
    assert old.worker.held == {"b", "slow"} and old.open and old.left_to is None
    assert (
        size == MEASURED - BASE - 50 + BASE // 4 + packs.PER_MODEL_BYTES
    )  # a share of the base: "b" shares it


def test_at_the_worker_cap_the_others_wait_for_the_load_and_no_worker_is_taken():
    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        pack_set, pool, old, recycles = pack_of_two(fresh)
        pool.cap_reached = True  # a spare is there, but no other worker may start after it
        _, reply, _, _ = await pack_set.load(ready_model("slow"), avoid=[])
        return pool, old, recycles, reply

    pool, old, recycles, reply = asyncio.run(scenario())
    assert reply["ok"] and pool.takes == 0 and recycles == []
    assert sorted(old.members) == ["a", "b", "slow"] and old.open


def test_a_load_that_runs_long_marks_its_model_and_a_quick_one_does_not():
    async def scenario():
        pack_set, _, old, _ = pack_of_two()  # no spare: nothing moves, the loads run where placed
        slow, quick = ready_model("slow"), ready_model("quick")
        await pack_set.load(slow, avoid=[])  # 0.3 s, past the threshold
        marked = slow.loads_slowly
        old.worker.load_seconds = 0.01
        await pack_set.load(quick, avoid=[])
        await pack_set.remove(slow)
        await pack_set.load(slow, avoid=[])  # loaded again quickly, as a heal may
        return marked, slow, quick

    marked, slow, quick = asyncio.run(scenario())
    assert marked and not quick.loads_slowly  # not loaded again beside serving models if it can be helped
    assert not slow.loads_slowly  # its latest load was quick


def test_a_model_whose_own_load_ran_long_stays_behind_and_the_pack_takes_models_again():
    async def scenario():
        fresh = StandInWorker("F", WorkerState.SPARE)
        pack_set, pool, old, _ = pack_of_two(fresh)
        a, b = old.members["a"], old.members["b"]
        a.loads_slowly = True  # loaded again, it would keep b's calls from switching until it was in
        _, reply, _, _ = await pack_set.load(ready_model("slow"), avoid=[])
        return pool, old, fresh, a, b, reply

    pool, old, fresh, a, b, reply = asyncio.run(scenario())
    assert reply["ok"] and b.workers == [fresh] and fresh.held == {"b"}  # b moved
    assert a.workers == [old.worker] and pool.loading.count("a") == 0  # a stayed, never reloaded
    # Not left to the slow load: a is charged there still, and the pack takes models as before.
    assert old.left_to is None and old.open and sorted(old.charged) == ["a", "slow"]
