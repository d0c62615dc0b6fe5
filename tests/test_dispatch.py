"""The dispatcher and the state machines, in-process against a fake pool: no processes, milliseconds."""

import asyncio
import time
import types

import grpc
import pytest

from runtime import dispatch, status
from runtime.budget import ByteBudget
from runtime.channel import PeerGone
from runtime.dispatch import Dispatcher, spliced
from runtime.model import Model, ModelState
from runtime.modelspec import ModelSpec
from runtime.pack import switch
from runtime.pool import WorkerPool
from runtime.settings import Settings
from runtime.worker import IllegalTransition, KillCause, Worker, WorkerState
from workers import formats

SETTINGS = Settings.from_env({"WORKER_REQUEST_TIMEOUT_MS": "0"})


class FakePool:
    """Answers calls the way the test says; kills with the pool's own kill()."""

    def __init__(self):
        self.sent: list[tuple[Worker, str, bytes]] = []
        self.replies: list[asyncio.Future] = []
        self.unanswered: list[int] = []

    def submit_call(
        self, worker, model_id, method, request, deadline, unanswered, on_end, overdue_after, on_overdue
    ):
        self.sent.append((worker, method, request))
        self.unanswered.append(unanswered)
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(lambda _: on_end())
        self.replies.append(future)
        self.on_overdue = on_overdue
        return future

    kill = WorkerPool.kill


def serving_worker(name: str = "w1") -> Worker:
    worker = Worker(name.encode(), process=None)
    for state in (WorkerState.SPARE, WorkerState.LOADING, WorkerState.SERVING):
        worker.change_state(state)
    worker.model_id = "m"
    return worker


def ready_model(*workers: Worker) -> Model:
    spec = ModelSpec("m", "/models/m", formats.by_name("python"), 10)
    model = Model(spec, SETTINGS)
    for worker in workers:
        model.workers.append(worker)
        model.replicas.add(worker)
    model.change_state(ModelState.READY)
    return model


def dispatcher_for(model: Model, pool: FakePool, settings: Settings = SETTINGS) -> Dispatcher:
    supervisor = types.SimpleNamespace(ready_model=lambda model_id: _found(model, model_id))
    budget = ByteBudget(settings.model_bytes_max, settings.front_bytes_max, settings.grpc_max_message_bytes)
    return Dispatcher(settings, supervisor, pool, budget)


def _found(model: Model, model_id: str) -> Model:
    if model_id != model.model_id or model.state is not ModelState.READY:
        raise status.model_not_found(model_id)
    return model


async def call_answered_with(
    reply=None, frames=(b"body",), error=None, timeout=None, worker=None, model=None, settings=SETTINGS
):
    """Runs one call, answers it as told; returns (outcome, dispatcher, pool)."""
    worker = worker or serving_worker()
    model = model or ready_model(worker)
    pool = FakePool()
    dispatcher = dispatcher_for(model, pool, settings)
    call = asyncio.ensure_future(
        dispatcher.call("m", "inference.GRPCInferenceService/ModelInfer", b"req", timeout)
    )
    await asyncio.sleep(0)
    if error is not None:
        pool.replies[0].set_exception(error)
    elif reply is not None:
        pool.replies[0].set_result((reply, list(frames)))
    try:
        return await call, dispatcher, pool
    except status.RpcError as raised:
        return raised, dispatcher, pool


def run(coroutine):
    return asyncio.run(coroutine)


# -- the life of one call ------------------------------------------------------------


def test_a_call_reaches_a_worker_and_its_reply_comes_back_whole():
    async def scenario():
        outcome, dispatcher, pool = await call_answered_with({"ok": True}, frames=(b"body",))
        worker = pool.sent[0][0]
        return outcome, dispatcher, worker

    outcome, dispatcher, worker = run(scenario())
    assert outcome == b"body"
    assert (worker.served, worker.in_flight, dispatcher.budget.held) == (1, 0, 0)


def test_each_call_tells_its_worker_how_many_of_the_models_calls_are_unanswered_per_replica():
    async def scenario():
        first, second = serving_worker("w1"), serving_worker("w2")
        model, pool = ready_model(first, second), FakePool()
        dispatcher = dispatcher_for(model, pool)
        calls = [asyncio.ensure_future(dispatcher.call("m", "x/y", b"r", None)) for _ in range(3)]
        await asyncio.sleep(0)
        for reply in pool.replies:
            reply.set_result(({"ok": True}, [b"body"]))
        await asyncio.gather(*calls)
        return pool.unanswered

    # One call on two replicas is one per replica (rounded up); the third call finds three unanswered.
    assert run(scenario()) == [1, 1, 2]


def test_raw_output_frames_are_spliced_as_repeated_fields():
    assert spliced([b"\x0a\x01m", b"abc"], 6) == b"\x0a\x01m" + b"\x32\x03abc"


def test_a_failed_reply_is_the_workers_status_and_counts_as_an_error():
    async def scenario():
        reply = {"ok": False, "error": "invalid_input", "message": "bad tensor"}
        return await call_answered_with(reply)

    outcome, _, pool = run(scenario())
    assert outcome.code is grpc.StatusCode.INVALID_ARGUMENT and outcome.message == "bad tensor"
    assert pool.sent[0][0].errors == 1


def test_a_worker_dying_under_a_call_is_unavailable():
    outcome, _, _ = run(call_answered_with(error=PeerGone(-9)))
    assert outcome.code is grpc.StatusCode.UNAVAILABLE and "killed by SIGKILL" in outcome.message


def test_a_worker_that_died_with_its_fork_server_is_unavailable_and_says_so():
    async def scenario():
        worker = serving_worker()
        worker.orphaned = True  # as the reaper found its fork server dead, and failed its calls with it
        return await call_answered_with(error=PeerGone(255, worker.death_cause), worker=worker)

    outcome, _, _ = run(scenario())
    assert outcome.code is grpc.StatusCode.UNAVAILABLE and "its fork server died" in outcome.message


def test_a_call_that_found_its_worker_gone_before_its_reap_says_how_it_died_once_reaped():
    async def scenario():
        worker = serving_worker()

        def reaped_as_its_fork_server_died():
            worker.orphaned = True
            worker.change_state(WorkerState.EXITED)
            worker.exited.set_result(255)

        asyncio.get_running_loop().call_later(0.05, reaped_as_its_fork_server_died)
        return await call_answered_with(error=PeerGone(None), worker=worker)  # its socket unreachable

    outcome, _, _ = run(scenario())
    assert outcome.code is grpc.StatusCode.UNAVAILABLE
    assert outcome.message == "the worker serving 'm' died (its fork server died)"


@pytest.mark.parametrize("killed_by_us", [False, True])
def test_a_call_waits_for_its_gone_workers_reap_only_within_its_deadline_and_not_after_our_kill(killed_by_us):
    async def scenario():
        worker = serving_worker()  # never reaped here
        if killed_by_us:
            worker.kill_cause = KillCause.OPERATOR
        started = time.monotonic()
        outcome, _, _ = await call_answered_with(
            error=PeerGone(None), worker=worker, timeout=None if killed_by_us else 0.05
        )
        return outcome, time.monotonic() - started

    outcome, seconds = run(scenario())
    assert outcome.code is grpc.StatusCode.UNAVAILABLE and seconds < dispatch.REAP_WAIT_SECONDS / 2


def test_a_worker_killed_for_memory_is_resource_exhausted():
    async def scenario():
        worker = serving_worker()
        pool = FakePool()
        call = asyncio.ensure_future(dispatcher_for(ready_model(worker), pool).call("m", "x/y", b"r", None))
        await asyncio.sleep(0)
        pool.kill(worker, KillCause.MEMORY, "over WORKER_MEMORY_LIMIT_BYTES: 9 MiB > 8 MiB")
        pool.replies[0].set_exception(PeerGone(-9))  # as the reaper fails the worker's calls
        with pytest.raises(status.RpcError) as raised:
            await call
        return worker, raised.value

    worker, error = run(scenario())
    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "WORKER_MEMORY_LIMIT_BYTES" in error.message
    assert worker.state is WorkerState.CONDEMNED and worker.death_label == "memory"


def test_a_call_as_the_model_is_unloaded_is_not_found():
    async def scenario():
        worker = serving_worker()
        model = ready_model(worker)
        model.unload_requested = True
        return await call_answered_with(error=PeerGone(-15), worker=worker, model=model)

    outcome, _, _ = run(scenario())
    assert outcome.code is grpc.StatusCode.NOT_FOUND


def test_a_call_its_pack_had_not_begun_goes_where_its_model_moved_when_the_pack_crashes():
    async def scenario():
        old, new = serving_worker("old"), serving_worker("new")
        model, pool = ready_model(old), FakePool()
        call = asyncio.ensure_future(dispatcher_for(model, pool).call("m", "x/y", b"r", None))
        await asyncio.sleep(0)
        switch(model, old, new)  # a load running long in the old pack moved the model out
        old.change_state(WorkerState.EXITED)  # that load crashed the pack, before it began the call
        pool.replies[0].set_exception(PeerGone(-9, begun=False))
        await asyncio.sleep(0)
        pool.replies[1].set_result(({"ok": True}, [b"body"]))
        return await asyncio.wait_for(call, 1), pool

    response, pool = run(scenario())
    assert response == b"body" and [sent[0].identity for sent in pool.sent] == [b"old", b"new"]


def test_a_call_whose_worker_is_reaped_before_its_turn_in_line_comes_fails_instead_of_waiting():
    async def scenario():
        worker = serving_worker()
        model, pool = ready_model(worker), FakePool()
        replicas = model.replicas
        for _ in range(replicas.slots):
            replicas.try_acquire()
        call = asyncio.ensure_future(dispatcher_for(model, pool).call("m", "x/y", b"r", None))
        await asyncio.sleep(0)
        replicas.release(worker)  # its turn: the worker is handed to it...
        worker.change_state(WorkerState.EXITED)  # ...and reaped before the call goes on
        with pytest.raises(status.RpcError) as raised:
            await asyncio.wait_for(call, 1)
        return raised.value, pool, worker, replicas.slots

    error, pool, worker, slots = run(scenario())
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert pool.sent == [] and worker.in_flight == slots - 1  # its slot given back, nothing sent


def test_calls_waiting_in_line_count_as_unanswered_and_released_ones_do_not():
    async def scenario():
        worker = serving_worker()
        model = ready_model(worker)
        replicas = model.replicas
        for _ in range(replicas.slots):
            replicas.try_acquire()
        waiting = asyncio.ensure_future(replicas.acquire())
        await asyncio.sleep(0)
        counts = [replicas.unanswered_per_replica()]
        replicas.release(worker)  # the one in line takes the slot
        await waiting
        replicas.release(worker)
        counts.append(replicas.unanswered_per_replica())
        return counts, replicas.slots

    counts, slots = run(scenario())
    assert counts == [slots + 1, slots - 1]


def test_calls_that_fail_or_give_up_in_line_leave_nothing_counted_as_unanswered():
    async def scenario():
        worker = serving_worker()
        model, pool = ready_model(worker), FakePool()
        dispatcher = dispatcher_for(model, pool)
        dying = asyncio.ensure_future(dispatcher.call("m", "x/y", b"r", None))
        await asyncio.sleep(0)
        pool.replies[0].set_exception(PeerGone(-9))
        with pytest.raises(status.RpcError):
            await dying
        for _ in range(model.replicas.slots):
            model.replicas.try_acquire()
        with pytest.raises(status.RpcError):  # its deadline passes in line
            await dispatcher.call("m", "x/y", b"r", 0.01)
        for _ in range(model.replicas.slots):
            model.replicas.release(worker)
        return model.replicas.unanswered

    assert run(scenario()) == 0


def test_the_deadline_counts_time_in_line():
    async def scenario():
        worker = serving_worker()
        model = ready_model(worker)
        for _ in range(model.replicas.slots):  # full: the call waits in line
            assert model.replicas.try_acquire() is worker
        pool = FakePool()
        dispatcher = dispatcher_for(model, pool)
        with pytest.raises(status.RpcError) as raised:
            await dispatcher.call("m", "x/y", b"r", 0.05)
        return raised.value, pool, dispatcher

    error, pool, dispatcher = run(scenario())
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert pool.sent == [] and dispatcher.budget.held == 0


def test_an_overdue_call_kills_its_worker_with_that_cause():
    settings = Settings.from_env({"WORKER_REQUEST_TIMEOUT_MS": "1000"})

    async def scenario():
        worker = serving_worker()
        pool = FakePool()
        call = asyncio.ensure_future(
            dispatcher_for(ready_model(worker), pool, settings).call("m", "x/y", b"r", None)
        )
        await asyncio.sleep(0)
        pool.replies[0].set_exception(pool.on_overdue())  # as the channel's timer does
        with pytest.raises(status.RpcError) as raised:
            await call
        return worker, raised.value

    worker, error = run(scenario())
    assert (
        error.code is grpc.StatusCode.DEADLINE_EXCEEDED and "WORKER_REQUEST_TIMEOUT_MS=1000" in error.message
    )
    assert worker.kill_cause is KillCause.REQUEST_TIMEOUT and worker.state is WorkerState.CONDEMNED


def test_a_response_over_the_message_limit_is_resource_exhausted():
    settings = Settings.from_env({"GRPC_MAX_MESSAGE_BYTES": str(4 * 2**20)})
    outcome, _, _ = run(call_answered_with({"ok": True}, frames=(b"x" * (4 * 2**20 + 1),), settings=settings))
    assert outcome.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "GRPC_MAX_MESSAGE_BYTES" in outcome.message


def test_an_unknown_model_is_not_found_before_any_byte_is_counted():
    async def scenario():
        dispatcher = dispatcher_for(ready_model(serving_worker()), FakePool())
        with pytest.raises(status.RpcError) as raised:
            await dispatcher.call("ghost", "x/y", b"r", None)
        return raised.value, dispatcher

    error, dispatcher = run(scenario())
    assert error.code is grpc.StatusCode.NOT_FOUND and dispatcher.budget.held == 0


# -- state machines ----------------------------------------------------------------


def test_a_worker_makes_only_the_moves_of_its_life():
    async def scenario():
        worker = Worker(b"w", process=None)
        with pytest.raises(IllegalTransition, match="starting -> serving"):
            worker.change_state(WorkerState.SERVING)  # no hello, no load
        worker.change_state(WorkerState.SPARE)
        with pytest.raises(IllegalTransition):
            worker.change_state(WorkerState.STARTING)
        worker.change_state(WorkerState.LOADING)
        worker.change_state(WorkerState.SERVING)
        with pytest.raises(IllegalTransition):
            worker.change_state(WorkerState.LOADING)  # one model per worker
        worker.change_state(WorkerState.CONDEMNED)
        with pytest.raises(IllegalTransition):
            worker.change_state(WorkerState.SERVING)  # killed workers take no more calls
        worker.change_state(WorkerState.EXITED)
        for state in WorkerState:
            with pytest.raises(IllegalTransition):
                worker.change_state(state)

    run(scenario())


def test_a_model_makes_only_the_moves_of_its_life():
    async def scenario():
        model = Model(ModelSpec("m", "/m", formats.by_name("python"), 1), SETTINGS)
        model.change_state(ModelState.READY)
        with pytest.raises(IllegalTransition, match="ready -> loading"):
            model.change_state(ModelState.LOADING)
        model.change_state(ModelState.UNLOADING)
        with pytest.raises(IllegalTransition):
            model.change_state(ModelState.READY)  # nothing brings an unloaded model back

    run(scenario())


def test_a_kill_keeps_its_first_cause_and_only_hurries_a_second_time():
    async def scenario():
        worker = serving_worker()
        signals = []
        worker.signal = lambda signum, whole_group=False: signals.append(signum)
        pool = FakePool()
        pool.kill(worker, KillCause.UNLOAD, "m is unloaded", 2.0)
        pool.kill(worker, KillCause.HUNG, "hung")
        return worker, signals

    worker, signals = run(scenario())
    assert worker.kill_cause is KillCause.UNLOAD and worker.death_label == "unload"
    assert signals[:2] == [15, 9]  # SIGTERM for the grace, then SIGKILL at once on the second kill


def test_a_response_over_the_limit_is_refused_before_its_frames_are_joined(monkeypatch):
    import runtime.dispatch

    def joined(frames, append_field):
        raise AssertionError("joined")

    async def scenario():
        dispatcher = dispatcher_for(ready_model(serving_worker()), FakePool())
        dispatcher.largest_response = 10
        monkeypatch.setattr(runtime.dispatch, "spliced", joined)
        with pytest.raises(status.RpcError) as raised:
            dispatcher._response("m", [b"x" * 8, b"y" * 8], 6)
        return raised.value

    error = run(scenario())
    assert error.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "16 bytes" in error.message
