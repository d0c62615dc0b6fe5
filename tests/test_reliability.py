"""Failure behaviour: crashes heal, crash loops drop, hung and greedy workers die, shutdown drains."""

import concurrent.futures
import os
import signal
import threading
import time

import grpc
import pytest
from harness import MiB, Runtime, alive, expect_status, tree, wait_until

from protos import grpc_predict_v2_pb2 as v2
from runtime.replicas import PIPELINE_DEPTH

# Misbehaves on request: "segv" segfaults, "sleep" sleeps 30 s, "nap" 3 s, "freeze" starts
# a thread that holds the GIL forever (a catastrophic regex), "grow" allocates
# 300 MiB and holds it for 5 s. Otherwise it answers with its pid.
TROUBLE = """
    import ctypes, os, re, threading, time
    import numpy as np

    class Model:
        def __init__(self, path):
            self.path = path
            if os.path.exists(os.path.join(path, "crashy")):
                threading.Timer(0.3, os._exit, (9,)).start()

        def predict(self, inputs):
            if "segv" in inputs:
                ctypes.string_at(0)
            if "sleep" in inputs:
                time.sleep(30)
            if "nap" in inputs:
                time.sleep(3)
            if "freeze" in inputs:
                threading.Timer(0.2, re.match, (r"(a+)+$", "a" * 64 + "b")).start()
            if "grow" in inputs:
                ballast = np.ones(300 * 1024 * 1024, dtype=np.uint8)
                time.sleep(5)
            return {"pid": np.array([os.getpid()], dtype=np.int64)}
"""


def ask(runtime, model_id, trouble=None, timeout=30):
    request = v2.ModelInferRequest(model_name=model_id)
    if trouble:
        request.inputs.add(name=trouble, datatype="INT32", shape=[1]).contents.int_contents.append(0)
    return runtime.infer.ModelInfer(request, timeout=timeout)


@pytest.fixture(scope="module")
def guarded():
    with Runtime(
        WORKER_REQUEST_TIMEOUT_MS="2000",
        WORKER_HEARTBEAT_TIMEOUT_MS="1500",
        # Low enough that "grow" crosses it well within the request timeout even where a page's
        # first touch is slow (a virtual machine's fresh memory).
        WORKER_MEMORY_LIMIT_BYTES=str(64 * MiB),
        MODEL_CRASH_LIMIT="3",
    ) as runtime:
        yield runtime


@pytest.fixture
def trouble(guarded):
    models = []

    def load(model_id, crashy=False):
        path = guarded.model_dir(model_id, TROUBLE)
        if crashy:
            open(os.path.join(path, "crashy"), "w").close()
        guarded.load(model_id, path)
        models.append(model_id)
        return guarded.worker_for(model_id)

    yield load
    for model_id in models:
        guarded.unload(model_id)


def test_sigkill_under_traffic_fails_fast_and_heals(guarded, trouble):
    victim = trouble("victim")
    trouble("bystander")
    outcomes, stop = [], threading.Event()

    def traffic(model_id):
        while not stop.is_set():
            started = time.monotonic()
            try:
                ask(guarded, model_id, timeout=20)
                outcomes.append((model_id, "ok", time.monotonic() - started))
            except grpc.RpcError as error:
                outcomes.append((model_id, error.code(), time.monotonic() - started))

    threads = [threading.Thread(target=traffic, args=(m,)) for m in ("victim", "victim", "bystander")]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    killed_at = time.monotonic()
    victim.kill()
    wait_until(
        lambda: (w := guarded.worker_for("victim")) is not None and w.pid != victim.pid,
        timeout=30,
        what="a new worker for the victim",
    )
    healed_after = time.monotonic() - killed_at
    time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join(30)
    assert healed_after <= 30
    assert all(code in ("ok", grpc.StatusCode.UNAVAILABLE) for _, code, _ in outcomes), outcomes
    assert all(model != "bystander" or code == "ok" for model, code, _ in outcomes)
    assert max(seconds for _, _, seconds in outcomes) < 20, "a request hung"
    assert [code for m, code, _ in outcomes if m == "victim"][-1] == "ok"


def test_segfault_fails_only_its_request(guarded, trouble):
    trouble("crasher")
    trouble("neighbour")
    error = expect_status(grpc.StatusCode.UNAVAILABLE, ask, guarded, "crasher", "segv")
    assert "SIGSEGV" in error.details()
    assert ask(guarded, "neighbour").outputs
    assert ask(guarded, "crasher").outputs  # healed
    assert "died (killed by SIGSEGV); healing" in guarded.log()


def test_crash_loop_drops_the_model(guarded, trouble):
    trouble("looper", crashy=True)
    wait_until(lambda: "dropping looper" in guarded.log(), timeout=30, what="the crash loop to be noticed")
    expect_status(grpc.StatusCode.NOT_FOUND, ask, guarded, "looper")
    assert guarded.worker_for("looper") is None


def test_request_past_worker_request_timeout_kills_and_heals(guarded, trouble):
    first = trouble("sleeper")
    error = expect_status(grpc.StatusCode.DEADLINE_EXCEEDED, ask, guarded, "sleeper", "sleep")
    assert "WORKER_REQUEST_TIMEOUT_MS" in error.details()
    wait_until(lambda: not alive([first]), what="the stuck worker to die")
    assert ask(guarded, "sleeper").outputs


def test_worker_that_stops_answering_heartbeats_is_killed(guarded, trouble):
    first = trouble("freezer")
    ask(guarded, "freezer", "freeze")
    wait_until(lambda: not alive([first]), timeout=15, what="the frozen worker to be killed")
    assert "hung: no heartbeat for" in guarded.log()
    assert ask(guarded, "freezer").outputs


@pytest.mark.slow  # idles through several heartbeat timeouts
def test_a_stopped_worker_is_killed_as_hung_and_idle_ones_are_left_alone(guarded, trouble):
    stopped = trouble("stopped")
    idle = [trouble("idle"), *guarded.spares()]
    stopped_at = time.monotonic()
    stopped.send_signal(signal.SIGSTOP)
    wait_until(lambda: not alive([stopped]), timeout=15, what="the stopped worker to be killed")
    # Its last beat may have come up to half the limit before it was stopped.
    assert time.monotonic() - stopped_at >= 1.5 / 2, "killed before WORKER_HEARTBEAT_TIMEOUT_MS"
    assert f"{stopped.pid} model=stopped>: hung: no heartbeat for" in guarded.log()
    time.sleep(max(0.0, stopped_at + 3 * 1.5 - time.monotonic()))  # three timeouts in all
    assert alive(idle) == idle, "an idle worker that beats was killed as hung"
    assert ask(guarded, "stopped").outputs


def test_memory_limit_gives_resource_exhausted_and_heals(guarded, trouble):
    first = trouble("greedy")
    error = expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, ask, guarded, "greedy", "grow")
    assert "WORKER_MEMORY_LIMIT_BYTES" in error.details()
    assert not alive([first])
    assert ask(guarded, "greedy").outputs


def test_oom_killer_prefers_workers_over_the_front(guarded, trouble):
    worker = trouble("scored")

    def score(pid):
        with open(f"/proc/{pid}/oom_score_adj") as adj:
            return int(adj.read())

    assert score(worker.pid) == 800
    assert score(guarded.pid) < score(worker.pid)


def test_workers_open_no_tcp_port(guarded, trouble):
    trouble("quiet")
    for worker in guarded.workers():
        assert worker.net_connections(kind="inet") == []


@pytest.mark.slow  # drains calls of 2 s each, then waits for the whole tree to end
def test_sigterm_lets_calls_under_way_finish():
    runtime = Runtime().start()
    runtime.load(
        "slow",
        runtime.model_dir(
            "slow",
            """
        import time
        class Model:
            def __init__(self, path):
                pass
            def predict(self, inputs):
                time.sleep(0.8)
                return inputs
    """,
        ),
    )
    processes = tree(runtime.pid)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        calls = [pool.submit(ask, runtime, "slow", None, 30) for _ in range(4)]
        time.sleep(0.5)
        stopped_at = time.monotonic()
        runtime.process.send_signal(signal.SIGTERM)
        for call in calls:
            call.result(timeout=30)  # each completes
    assert runtime.process.wait(15) == 0
    assert time.monotonic() - stopped_at <= 15
    wait_until(lambda: not alive(processes), timeout=5, what="no process left")
    runtime.stop()


def test_heal_without_a_free_worker_drops_the_model():
    # WORKERS_MAX=2: A and B fill the cap; A crashes, and C's load takes the freed
    # slot during A's heal backoff (0.1 s), so A has no process to heal into.
    with Runtime(WORKERS_WARM="0", WORKERS_MAX="2") as runtime:
        runtime.load("a", runtime.model_dir("a", TROUBLE))
        runtime.load("b", runtime.model_dir("b", TROUBLE))
        expect_status(grpc.StatusCode.UNAVAILABLE, ask, runtime, "a", "segv")
        runtime.load("c", runtime.model_dir("c", TROUBLE))
        wait_until(lambda: "dropping a: cannot heal it" in runtime.log(), what="a to be dropped")
        expect_status(grpc.StatusCode.NOT_FOUND, ask, runtime, "a")
        assert ask(runtime, "b").outputs and ask(runtime, "c").outputs


@pytest.mark.slow  # waits out a 3 s nap
def test_a_call_its_client_gave_up_on_still_counts_as_work():
    # The caller leaves after 0.3 s; the worker naps 3 s, past the 1 s heartbeat
    # timeout: it is busy, not hung, so it must not be killed.
    with Runtime(WORKER_HEARTBEAT_TIMEOUT_MS="1000") as runtime:
        runtime.load("napper", runtime.model_dir("napper", TROUBLE))
        worker = runtime.worker_for("napper")
        expect_status(grpc.StatusCode.DEADLINE_EXCEEDED, ask, runtime, "napper", "nap", timeout=0.3)
        time.sleep(3.5)
        assert alive([worker]), "a busy worker was killed as hung"
        assert ask(runtime, "napper").outputs


@pytest.mark.slow  # waits out WORKER_REQUEST_TIMEOUT_MS
def test_abandoned_stuck_calls_still_hit_the_request_timeout():
    with Runtime(WORKER_THREADS="2", WORKER_REQUEST_TIMEOUT_MS="1500") as runtime:
        runtime.load("stuck", runtime.model_dir("stuck", TROUBLE))
        first = runtime.worker_for("stuck")
        for _ in range(2):  # both threads; each caller is gone after 0.3 s
            expect_status(grpc.StatusCode.DEADLINE_EXCEEDED, ask, runtime, "stuck", "sleep", timeout=0.3)
        wait_until(lambda: not alive([first]), timeout=10, what="the stuck worker to be killed")
        assert ask(runtime, "stuck").outputs


def test_calls_queued_in_a_worker_are_not_overdue_for_the_time_they_waited():
    with Runtime(WORKER_REQUEST_TIMEOUT_MS="2000") as runtime:
        runtime.load(
            "napper", runtime.model_dir("napper", TROUBLE.replace("time.sleep(3)", "time.sleep(0.5)"))
        )
        worker = runtime.worker_for("napper")
        with concurrent.futures.ThreadPoolExecutor(5) as callers:  # 2.5 s of naps, 0.5 s each
            calls = [callers.submit(ask, runtime, "napper", "nap") for _ in range(5)]
            assert all(call.result().outputs for call in calls)
        assert alive([worker]) and "WORKER_REQUEST_TIMEOUT_MS" not in runtime.log()


# Dies DELAY seconds after its constructor returns (DELAY read from the file "delay").
RACER = """
    import os, threading
    import numpy as np

    class Model:
        def __init__(self, path):
            with open(os.path.join(path, "delay")) as delay:
                threading.Timer(float(delay.read()), os._exit, (5,)).start()

        def predict(self, inputs):
            return {"ok": np.array([1], dtype=np.int32)}
"""


def test_worker_dying_right_after_its_load_reply_never_leaves_a_dead_model():
    with Runtime(MODEL_CRASH_LIMIT="1") as runtime:
        path = runtime.model_dir("racer", RACER)
        for attempt in range(12):
            with open(os.path.join(path, "delay"), "w") as delay:
                delay.write(str(attempt / 1000))
            try:
                runtime.load("racer", path)
                loaded = True
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
                loaded = False
            if loaded:  # the death is then seen: NOT_FOUND (dropped) or an answer, never a hang
                try:
                    ask(runtime, "racer", timeout=10)
                except grpc.RpcError as error:
                    assert error.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE), (
                        error.code()
                    )
            runtime.unload("racer")


def test_second_load_of_a_loading_model_answers_cancelled_when_unloaded():
    from test_management import GATED_MODEL

    with Runtime() as runtime:
        path = runtime.model_dir("twice", GATED_MODEL)
        first, second = runtime.load_future("twice", path), runtime.load_future("twice", path)
        wait_until(lambda: runtime.worker_for("twice"), what="the load to start")
        time.sleep(0.2)
        runtime.unload("twice")
        for future in (first, second):
            assert future.exception(timeout=10).code() == grpc.StatusCode.CANCELLED


# Naps for as long as its input's value says (ms) and notes each call it runs in ran.txt.
NAPPER = """
    import os, time
    import numpy as np

    class Model:
        def __init__(self, path):
            self.path = path

        def predict(self, inputs):
            name, value = next(iter(inputs.items()))
            with open(os.path.join(self.path, "ran.txt"), "a") as log:
                log.write(name + "\\n")
            time.sleep(int(value.ravel()[0]) / 1000)
            return {"pid": np.array([os.getpid()], dtype=np.int64)}
"""


def nap(runtime, model_id, name, ms, timeout=30):
    request = v2.ModelInferRequest(model_name=model_id)
    request.inputs.add(name=name, datatype="INT32", shape=[1]).contents.int_contents.append(ms)
    return runtime.infer.ModelInfer(request, timeout=timeout)


def in_background(call, *args, **kwargs) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(call, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


def test_callers_in_line_when_a_worker_dies_wait_for_its_replacement():
    """The dead worker is never handed to a caller waiting in the model's line."""
    with Runtime(WORKERS_WARM="1") as rt:
        rt.load("liner", rt.model_dir("liner", NAPPER))
        victim = rt.worker_for("liner")
        holding = [in_background(nap, rt, "liner", f"hold{i}", 5000) for i in range(1 + PIPELINE_DEPTH)]
        time.sleep(0.5)  # the worker now holds all it may hold
        waiting = [in_background(nap, rt, "liner", f"wait{i}", 0, timeout=25) for i in range(3)]
        time.sleep(0.5)
        victim.kill()
        for call in holding:
            assert call.exception(30).code() == grpc.StatusCode.UNAVAILABLE
        for call in waiting:
            assert call.result(30).outputs[0].contents.int64_contents[0] != victim.pid


@pytest.mark.slow  # a line of calls of 1 s each
def test_time_in_line_counts_against_the_deadline_the_worker_gets():
    """A call that waited in line is dropped by the worker once its client's deadline passed."""
    with Runtime(WORKERS_WARM="1") as rt:
        path = rt.model_dir("queue", NAPPER)
        rt.load("queue", path)
        holding = [in_background(nap, rt, "queue", f"hold{i}", 1000) for i in range(1 + PIPELINE_DEPTH)]
        time.sleep(0.3)
        # Sent at about 1 s, when the first nap ends; the worker reaches it at about 3 s.
        # Its 2.5 s deadline has passed then, counted from arrival (not from 1 s + 2.5 s).
        late = in_background(nap, rt, "queue", "late", 0, timeout=2.5)
        assert late.exception(30).code() == grpc.StatusCode.DEADLINE_EXCEEDED
        for call in holding:
            call.result(30)
        time.sleep(1.5)
        with open(os.path.join(path, "ran.txt")) as ran:
            assert "late" not in ran.read().split(), "the worker ran a call its client had given up on"
