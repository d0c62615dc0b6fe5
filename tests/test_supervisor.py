"""The supervisor's model life cycle and the replica set, in-process against a fake pool.

No process is started: the fake pool hands out Worker objects, answers loads as the test says,
and "reaps" a killed worker at once. A state-machine bug shows here in milliseconds.
"""

import asyncio
import os

import grpc
import pytest

from runtime import status
from runtime.metrics import Metrics
from runtime.model import ModelState
from runtime.modelspec import ModelSpec
from runtime.pool import WorkerPool
from runtime.replicas import ReplicaSet
from runtime.settings import Settings
from runtime.spares import Spares
from runtime.supervisor import Supervisor
from runtime.worker import KillCause, Worker, WorkerState
from workers import formats


class CountedNotes:
    """Stands for the front's heap trimmer: counts what asked it to trim."""

    def __init__(self):
        self.notes = 0

    def note(self) -> None:
        self.notes += 1


class FakePool:
    """Spares on demand; loads answered by `answer_load`; a kill reaps the worker at once."""

    def __init__(self, settings, on_worker_exit):
        self.on_worker_exit = on_worker_exit
        self.heap = CountedNotes()
        self.taken: list[Worker] = []
        self.answer_load = lambda worker: {"ok": True}
        self.ready = True

    async def take(self, format_name: str) -> Worker:
        worker = Worker(f"w{len(self.taken) + 1}".encode(), process=None)
        worker.pid = os.getpid()  # measured as this process: some memory, never zero
        worker.change_state(WorkerState.SPARE)
        self.taken.append(worker)
        return worker

    def replenish(self) -> None:
        pass

    async def send_load(self, worker, model_id, format_name, path) -> dict:
        worker.model_id = model_id
        worker.change_state(WorkerState.LOADING)
        reply = self.answer_load(worker)
        if asyncio.isfuture(reply) or asyncio.iscoroutine(reply):
            reply = await reply
        if reply["ok"] and worker.state is WorkerState.LOADING:
            worker.change_state(WorkerState.SERVING)
        return reply

    def kill(self, worker, cause, reason, grace=0.0) -> None:
        worker.signal = lambda signum, whole_group=False: None  # the reaping below stands for it
        WorkerPool.kill(self, worker, cause, reason)
        self.reap(worker, -9)

    def reap(self, worker, code) -> None:
        if worker.state is WorkerState.EXITED:
            return
        worker.change_state(WorkerState.EXITED)
        worker.exited.set_result(code)
        self.on_worker_exit(worker, code)


def supervisor(**env) -> Supervisor:
    # A worker per model: FakePool has no packs (tests/test_pack_sizes.py scripts those).
    settings = Settings.from_env({"LOADTIME_TIMEOUT": "500", "MODELS_PER_WORKER": "1", **env})
    return Supervisor(settings, Metrics(), pool_factory=FakePool)


def spec(model_id: str = "m") -> ModelSpec:
    return ModelSpec(model_id, f"/models/{model_id}", formats.by_name("python"), 100)


def run(coroutine):
    return asyncio.run(coroutine)


def test_a_load_makes_the_model_ready_with_its_measured_size_and_is_idempotent():
    async def scenario():
        sup = supervisor()
        size = await sup.load(spec())
        again = await sup.load(spec())
        return sup, size, again

    sup, size, again = run(scenario())
    assert size > 0 and again == size
    assert len(sup.pool.taken) == 1 and sup.pool.taken[0].state is WorkerState.SERVING
    assert sup.ready_model("m").state is ModelState.READY
    assert sup.pool.heap.notes == 1, "the load asks the front to give back what it freed meanwhile"


def test_a_failed_load_answers_only_once_its_worker_is_gone(caplog):
    caplog.set_level("INFO", logger="mesh.supervisor")

    async def scenario():
        sup = supervisor()
        sup.pool.answer_load = lambda worker: {"ok": False, "error": "load", "message": "SyntaxError: x"}
        with pytest.raises(status.RpcError) as raised:
            await sup.load(spec())
        return sup, raised.value

    sup, error = run(scenario())
    assert error.code is grpc.StatusCode.FAILED_PRECONDITION and "SyntaxError" in error.message
    worker = sup.pool.taken[0]
    assert worker.state is WorkerState.EXITED and worker.kill_cause is KillCause.UNLOAD
    assert not sup.is_known("m")
    assert "m unloaded" not in caplog.text, "a model never loaded is not unloaded"
    assert "m gone, its load unfinished; its memory is back" in caplog.text


def test_a_load_past_its_timeout_is_deadline_exceeded_and_its_worker_killed():
    async def scenario():
        sup = supervisor()
        sup.pool.answer_load = lambda worker: asyncio.get_running_loop().create_future()  # never answers
        with pytest.raises(status.RpcError) as raised:
            await sup.load(spec())
        return sup, raised.value

    sup, error = run(scenario())
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert sup.pool.taken[0].state is WorkerState.EXITED and not sup.is_known("m")


def test_a_load_that_times_out_waiting_for_a_spare_says_it_never_started_and_for_which_fork_server():
    async def scenario():
        sup = supervisor()
        waiting = Spares(1, ("base",))  # no spare ever comes: its fork server is hung, say

        async def take(format_name: str) -> Worker:
            await waiting.wait("base")
            raise AssertionError("no spare was made")

        sup.pool.take = take
        with pytest.raises(status.RpcError) as raised:
            await sup.load(spec())
        return sup, raised.value

    sup, error = run(scenario())
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not start" in error.message and "a worker of the base fork server" in error.message
    assert "its worker was killed" not in error.message  # it never had one
    assert not sup.is_known("m")


def test_a_load_that_times_out_waiting_for_a_load_slot_says_so():
    async def scenario():
        sup = supervisor(MAX_LOADING_CONCURRENCY="1")
        await sup._load_slots.acquire()  # another load holds the only slot all along
        with pytest.raises(status.RpcError) as raised:
            await sup.load(spec())
        return sup, raised.value

    sup, error = run(scenario())
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not start" in error.message and "MAX_LOADING_CONCURRENCY=1" in error.message
    assert not sup.pool.taken


def test_unload_returns_once_every_worker_is_reaped_and_unknown_ids_at_once():
    async def scenario():
        sup = supervisor(MODEL_REPLICAS="2")
        await sup.load(spec())
        await sup.unload("m")
        await sup.unload("never-loaded")
        return sup

    sup = run(scenario())
    assert [w.state for w in sup.pool.taken] == [WorkerState.EXITED, WorkerState.EXITED]
    assert all(w.kill_cause is KillCause.UNLOAD for w in sup.pool.taken)
    with pytest.raises(status.RpcError) as raised:
        sup.ready_model("m")
    assert raised.value.code is grpc.StatusCode.NOT_FOUND
    # Every load and every unload asks the front to give its freed heap back: a packed unload
    # reaps no worker.
    assert sup.pool.heap.notes == 2


def test_a_crashed_worker_heals_into_a_fresh_one_and_a_model_that_keeps_crashing_is_dropped():
    async def scenario():
        sup = supervisor(MODEL_CRASH_LIMIT="2")
        await sup.load(spec())
        first = sup.pool.taken[0]
        sup.pool.reap(first, -11)  # a segfault, not a kill
        await asyncio.wait_for(sup.ready_model("m").heal_task, 5)
        healed = sup.pool.taken[1]
        states_after_heal = (healed.state, sup.ready_model("m").replicas.workers == [healed])
        sup.pool.reap(healed, -11)  # the second crash within the window: dropped
        await asyncio.sleep(0)
        return sup, first, states_after_heal

    sup, first, (healed_state, serves) = run(scenario())
    assert first.death_label == "crash"
    assert healed_state is WorkerState.SERVING and serves
    assert not sup.is_known("m"), "a model that crashed MODEL_CRASH_LIMIT times must be dropped"


def test_the_replica_set_picks_the_least_busy_serving_worker_and_serves_its_line_in_order():
    async def scenario():
        replicas = ReplicaSet("m", slots=1, queue_max=2)
        busy, idle = (Worker(name, process=None) for name in (b"a", b"b"))
        for worker in (busy, idle):
            for state in (WorkerState.SPARE, WorkerState.LOADING, WorkerState.SERVING):
                worker.change_state(state)
        replicas.add(busy)
        assert replicas.try_acquire() is busy  # its one slot taken
        replicas.add(idle)
        assert replicas.try_acquire() is idle  # the least busy
        first, second = (asyncio.ensure_future(replicas.acquire()) for _ in range(2))
        await asyncio.sleep(0)
        with pytest.raises(status.RpcError) as raised:
            await replicas.acquire()  # two already wait: MODEL_QUEUE_MAX
        assert raised.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        replicas.release(busy)
        assert await first is busy and not second.done()  # in order
        replicas.fail_line(status.model_not_found("m"))
        with pytest.raises(status.RpcError):
            await second

    run(scenario())


def test_a_heal_that_finds_the_model_served_again_after_its_backoff_takes_no_worker():
    async def scenario():
        sup = supervisor()
        await sup.load(spec())
        model = sup.ready_model("m")
        sup.pool.reap(sup.pool.taken[0], -9)  # the heal starts, and waits its backoff
        # Meanwhile the model is served again (a pack recycle moved it into a fresh pack).
        model.workers.append(await sup.pool.take("python"))
        await model.heal_task
        return sup

    sup = run(scenario())
    assert len(sup.pool.taken) == 2, "the heal took no worker of its own"
