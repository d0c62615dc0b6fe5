"""Packs: small models sharing one worker process (runtime/packs.py), end to end.

Each test starts a runtime with MODELS_PER_WORKER > 1 and python models,
and judges from outside: process titles and pids, answers, sizes, the log.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import grpc
import psutil
import pytest
from harness import (
    REPO,
    MiB,
    Runtime,
    alive,
    allocating_model,
    expect_status,
    free_port,
    metric_sample,
    scrape_metrics,
    wait_until,
)

from protos import model_runtime_pb2 as mm
from runtime import packs
from runtime.admin import cli
from workers import formats

PYTHON_KEY = json.dumps({"model_type": {"name": "python"}})


def parking_model(then: str = "") -> str:
    """A model whose load parks 8 MiB in a module that outlives it (numpy), then runs `then`."""
    return f"""
    import numpy as np

    class Model:
        def __init__(self, path):
            parked = getattr(np, "_parked_by_test", [])
            parked.append(np.ones(8 * 1024 * 1024, dtype=np.uint8))
            np._parked_by_test = parked
            {then}

        def predict(self, inputs):
            return dict(inputs)
    """


# A model that keeps memory after it is dropped: its pack cannot shrink when it goes.
LEAKY_MODEL = parking_model()

# A model whose first load in a process writes what later loads reuse: a module it imports.
IMPORTING_MODEL = """
    import xml.dom.minidom

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            return dict(inputs)
"""

# A model whose predict kills its own process: the whole pack dies with it.
CRASHING_MODEL = """
    import os, signal

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            os.kill(os.getpid(), signal.SIGKILL)
"""

# A model whose load kills the process it loads in.
CRASHING_LOAD = """
    import os, signal

    class Model:
        def __init__(self, path):
            os.kill(os.getpid(), signal.SIGKILL)
"""

# A model whose predict says it has begun (a file "begun" in its folder), then kills its process.
CRASHING_LATE_MODEL = """
    import os, signal, time

    class Model:
        def __init__(self, path):
            self.path = path

        def predict(self, inputs):
            open(os.path.join(self.path, "begun"), "w").close()
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
"""

# A model whose every call runs for two minutes.
STUCK_CALL_MODEL = """
    import time

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            time.sleep(120)
            return dict(inputs)
"""

# A model whose predict raises: only that call fails.
RAISING_MODEL = """
    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            raise ValueError("this model cannot digest that")
"""

# Two calls must be inside predict at once to pass the barrier: calls run one at a time fail.
MEETING_MODEL = """
    import threading

    MEETING = threading.Barrier(2, timeout=10)

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            MEETING.wait()
            return dict(inputs)
"""

# A model whose load parks memory, then fails: its pack is recycled.
FAILING_LEAKY_MODEL = parking_model('raise RuntimeError("parked 8 MiB, then failed")')

# A model that loads slowly once a file named "slow" is in its folder: a recycle that moves it
# takes that long.
SLOW_WHEN_TOLD_MODEL = """
    import os, time

    class Model:
        def __init__(self, path):
            if os.path.exists(os.path.join(path, "slow")):
                time.sleep(2)

        def predict(self, inputs):
            return dict(inputs)
"""

# Its first load once a file named "slow" is in its folder takes two seconds; the next ones do not.
SLOW_ONCE_MODEL = """
    import os, time

    class Model:
        def __init__(self, path):
            told = os.path.join(path, "slow")
            if os.path.exists(told):
                os.remove(told)
                time.sleep(2)

        def predict(self, inputs):
            return dict(inputs)
"""

# Every load of it but the first takes a second: the second replica's, and a move's.
SLOW_AFTER_FIRST_MODEL = """
    import os, time

    class Model:
        def __init__(self, path):
            marker = os.path.join(path, "loaded-once")
            if os.path.exists(marker):
                time.sleep(1)
            open(marker, "w").close()

        def predict(self, inputs):
            return dict(inputs)
"""

# A model that fails a call if it is closed while the call runs.
CLOSE_AFTER_CALLS_MODEL = """
    import time

    class Model:
        def __init__(self, path):
            self.closed = False

        def predict(self, inputs):
            time.sleep(1)
            if self.closed:
                raise RuntimeError("closed under a call")
            return dict(inputs)

        def close(self):
            self.closed = True
"""

# A model that takes its time to load: a load cancelled meanwhile may still run in the pack.
SLOW_MODEL = """
    import time

    class Model:
        def __init__(self, path):
            time.sleep(3)

        def predict(self, inputs):
            return dict(inputs)
"""


# A model whose load waits until a file named "go" appears in its folder (a minute at most).
GATED_MODEL = """
    import os, time

    class Model:
        def __init__(self, path):
            deadline = time.monotonic() + 60
            while not os.path.exists(os.path.join(path, "go")) and time.monotonic() < deadline:
                time.sleep(0.02)

        def predict(self, inputs):
            return dict(inputs)
    """


def packed(**env) -> Runtime:
    settings = {"MODELS_PER_WORKER": "4", "WORKERS_WARM": "1", "MODEL_PACK_MAX_BYTES": str(32 * MiB)}
    return Runtime(**{**settings, **env})


def answers(rt: Runtime, model_id: str) -> bool:
    return list(rt.infer_fp32(model_id, [2.5]).outputs[0].contents.fp32_contents) == [2.5]


def answers_by_now(rt: Runtime, model_id: str) -> bool:
    """answers(), False while its pack's death still fails its calls."""
    try:
        return answers(rt, model_id)
    except grpc.RpcError:
        return False


def predicted_size(rt: Runtime, model_id: str) -> int:
    path = rt.model_dir(model_id)
    request = mm.PredictModelSizeRequest(modelId=model_id, modelPath=path, modelKey=PYTHON_KEY)
    return rt.mesh.predictModelSize(request, timeout=0.5).sizeInBytes


def inspect_command(rt: Runtime) -> list[str]:
    return [os.path.join(REPO, "scripts", "inspect-workers"), "--runtime-dir", rt.env["RUNTIME_DIR"]]


def inspected(rt: Runtime) -> dict:
    """What inspect-workers --json shows: its code, run here; a process of its own would cost each look
    (tests poll with it) 0.3 s of start. test_inspect_workers_shows_each_pack... runs the script too."""
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        cli.inspect_workers(["--json", "--runtime-dir", rt.env["RUNTIME_DIR"]])
    return json.loads(shown.getvalue())


def pack_pids(rt: Runtime) -> set[int]:
    return {p.pid for p in alive(rt.packs())}


def busy_in(rt: Runtime, model_id: str) -> bool:
    """Whether inspect-workers shows a call in flight in the model's pack."""
    return any(
        row["in_flight"] > 0 and model_id in [m["model"] for m in row.get("models", [])]
        for row in inspected(rt)["workers"]
    )


def pack_row(rt: Runtime, pid: int) -> dict:
    """inspect-workers' row of the pack `pid`."""
    return next(row for row in inspected(rt)["workers"] if row["pid"] == pid)


def test_small_models_share_packs_each_answers_and_unloading_all_ends_them():
    with packed() as rt:
        first_guess = predicted_size(rt, "m0")
        sizes = [rt.load(f"m{i}", rt.model_dir(f"m{i}")).sizeInBytes for i in range(6)]
        # Predicted as packed models, conservatively: below a worker of its own (the floor, 8 MiB),
        # and once a pack has measured its base, close to what a packed model costs.
        assert sizes[0] <= first_guess < 8 * MiB, (sizes, first_guess)
        assert max(sizes) <= predicted_size(rt, "m6") < 2 * MiB, sizes
        assert len(pack_pids(rt)) == 2, "six models, four per pack"
        assert rt.model_workers() == 0, "no model has a worker of its own"
        assert all(answers(rt, f"m{i}") for i in range(6))
        # Each size is what the load added to its pack: far below a worker of its own.
        assert all(0 < size < 2 * MiB for size in sizes), sizes
        before = pack_pids(rt)
        # Not m0: the first load into a pack also pays the pack's first-use costs.
        rt.unload("m1")
        assert pack_pids(rt) == before, "an echo model gives back what its load added: no recycle"
        assert all(answers(rt, f"m{i}") for i in range(6) if i != 1)
        expect_status(grpc.StatusCode.NOT_FOUND, rt.infer_fp32, "m1", [1.0])
        for i in (2, 3, 5, 0, 4):
            rt.unload(f"m{i}")
        assert not pack_pids(rt) and not any(psutil.pid_exists(pid) for pid in before)


def test_a_model_that_leaves_memory_behind_has_its_pack_recycled_before_unload_returns():
    with packed(METRICS_PORT=str(free_port())) as rt:
        for model_id in ("a", "b"):
            rt.load(model_id, rt.model_dir(model_id, IMPORTING_MODEL))
        leaky = rt.load("leaky", rt.model_dir("leaky", LEAKY_MODEL)).sizeInBytes
        assert leaky >= 8 * MiB
        (old,) = pack_pids(rt)
        rt.unload("leaky")
        assert not psutil.pid_exists(old), "the old pack is reaped before unloadModel returns"
        (fresh,) = pack_pids(rt)
        assert fresh != old
        assert answers(rt, "a") and answers(rt, "b"), "the survivors moved to the fresh pack"
        assert "recycling" in rt.log()
        assert metric_sample(scrape_metrics(rt), "mesh_pack_recycle_seconds_count") == 1
        assert metric_sample(scrape_metrics(rt), "mesh_pack_models_moved_total") == 2
        # The first model moved in is not judged by the module the fresh pack's first load
        # imported for all, which no drop gives back, but by what it added in its old pack.
        rt.unload("a")
        assert pack_pids(rt) == {fresh}
        assert metric_sample(scrape_metrics(rt), "mesh_pack_recycle_seconds_count") == 1


def test_drops_that_each_keep_less_than_the_slack_recycle_the_pack_once_they_add_up():
    # Each of its drops keeps 96 KiB, under RECYCLE_SLACK_BYTES: thousands of them in a pack's life
    # would grow it without bound (and have every later load judged too big for a pack).
    keeping = parking_model().replace("8 * 1024 * 1024", "96 * 1024")
    with packed() as rt:
        rt.load("a", rt.model_dir("a"))
        path = rt.model_dir("keeping", keeping)
        rt.load("k1", path)
        (old,) = pack_pids(rt)
        rt.unload("k1")
        assert pack_pids(rt) == {old}, "one drop under the slack keeps its pack"
        rt.load("k2", path)
        rt.unload("k2")
        assert not psutil.pid_exists(old), "the second one's 96 KiB more passed the slack in all"
        assert "kept in all" in rt.log()
        assert answers(rt, "a")


def test_a_recycle_whose_fresh_pack_cannot_load_the_survivors_ends_it_and_they_heal():
    with packed(MODEL_CRASH_LIMIT="1") as rt:  # the old pack's end is not a crash of theirs
        gone = rt.model_dir("gone")
        for model_id in ("gone", "b"):
            rt.load(model_id, rt.model_dir(model_id))
        rt.load("leaky", rt.model_dir("leaky", LEAKY_MODEL))
        (old,) = pack_pids(rt)
        shutil.rmtree(gone)  # its files vanish: the fresh pack cannot load the first survivor
        rt.unload("leaky")
        assert "cannot move models into" in rt.log() and not psutil.pid_exists(old)
        wait_until(lambda: answers(rt, "b"), timeout=20, what="the survivor healed into a new pack")
        wait_until(lambda: len(pack_pids(rt)) == 1, timeout=20, what="no pack left over")


def test_a_survivor_that_cannot_load_in_the_fresh_pack_does_not_keep_the_others_from_moving():
    with packed() as rt:
        gone = rt.model_dir("gone")
        for model_id in ("a", "gone", "c"):  # a loads first and alone; gone and c are sent together
            rt.load(model_id, rt.model_dir(model_id) if model_id != "gone" else gone)
        rt.load("leaky", rt.model_dir("leaky", LEAKY_MODEL))
        (old,) = pack_pids(rt)
        shutil.rmtree(gone)
        rt.unload("leaky")
        (fresh,) = pack_pids(rt)
        assert fresh != old and not psutil.pid_exists(old)
        assert "gone did not load in" in rt.log()
        assert answers(rt, "a") and answers(rt, "c"), "the survivors that loaded moved"
        assert pack_pids(rt) == {fresh}, "they serve from the fresh pack, not from one they healed into"


def test_a_pack_crash_heals_the_neighbours_and_drops_only_the_model_that_crashed_it():
    with packed(MODEL_CRASH_LIMIT="2") as rt:
        for model_id in ("a", "b"):
            rt.load(model_id, rt.model_dir(model_id))
        rt.load("bad", rt.model_dir("bad", CRASHING_MODEL))
        for _ in range(2):
            expect_status(grpc.StatusCode.UNAVAILABLE, rt.infer_fp32, "bad", [1.0])
            wait_until(lambda: "dropping bad" in rt.log() or "healed bad" in rt.log(), timeout=20)
        wait_until(lambda: "dropping bad" in rt.log(), timeout=20, what="the crashing model dropped")
        expect_status(grpc.StatusCode.NOT_FOUND, rt.infer_fp32, "bad", [1.0])
        wait_until(lambda: answers(rt, "a") and answers(rt, "b"), timeout=20, what="the neighbours healed")
        assert "dropping a:" not in rt.log() and "dropping b:" not in rt.log()


def test_a_load_that_crashes_its_pack_fails_and_only_that_packs_models_heal():
    with packed() as rt:
        for i in range(4):
            rt.load(f"full{i}", rt.model_dir(f"full{i}"))
        (full,) = pack_pids(rt)
        rt.load("neighbour", rt.model_dir("neighbour"))
        (crashing,) = pack_pids(rt) - {full}  # the only pack with room: the next load goes there
        error = expect_status(
            grpc.StatusCode.FAILED_PRECONDITION, rt.load, "crasher", rt.model_dir("crasher", CRASHING_LOAD)
        )
        assert "died" in error.details(), error.details()
        wait_until(lambda: answers(rt, "neighbour"), timeout=20, what="the neighbour healed")
        assert not psutil.pid_exists(crashing) and full in pack_pids(rt), "only the crashed pack went"
        assert all(answers(rt, f"full{i}") for i in range(4))
        expect_status(grpc.StatusCode.NOT_FOUND, rt.infer_fp32, "crasher", [1.0])


def test_a_pack_crash_counts_against_the_model_it_ran_not_a_neighbour_whose_call_waited():
    with packed(MODEL_CRASH_LIMIT="2") as rt, concurrent.futures.ThreadPoolExecutor(2) as calls:
        rt.load("a", rt.model_dir("a"))
        folder = rt.model_dir("bad", CRASHING_LATE_MODEL)
        rt.load("bad", folder)
        for _ in range(2):
            wait_until(lambda: answers_by_now(rt, "a") and one_pack_holds(rt, "a", "bad"), timeout=20)
            crashing = calls.submit(rt.infer_fp32, "bad", [1.0])
            wait_until(lambda: os.path.exists(os.path.join(folder, "begun")), timeout=10, what="bad's call")
            os.unlink(os.path.join(folder, "begun"))
            waiting = calls.submit(rt.infer_fp32, "a", [1.0])  # in line behind bad's call in their pack
            for call in (crashing, waiting):
                assert call.exception(timeout=20).code() is grpc.StatusCode.UNAVAILABLE
        wait_until(lambda: "dropping bad" in rt.log(), timeout=20, what="the crashing model dropped")
        wait_until(lambda: answers_by_now(rt, "a"), timeout=20, what="the neighbour healed")
        assert "dropping a:" not in rt.log()


@pytest.mark.parametrize("threads", ["1", "4"])  # with call threads too: the main thread runs the load
def test_loads_that_crash_their_pack_count_against_none_of_its_models(threads):
    with packed(MODEL_CRASH_LIMIT="2", WORKER_THREADS=threads) as rt:
        rt.load("neighbour", rt.model_dir("neighbour"))
        for _ in range(3):  # model-mesh retries a failed load
            wait_until(lambda: answers_by_now(rt, "neighbour"), timeout=20, what="the neighbour healed")
            error = expect_status(
                grpc.StatusCode.FAILED_PRECONDITION,
                rt.load,
                "crasher",
                rt.model_dir("crasher", CRASHING_LOAD),
            )
            assert "died" in error.details(), error.details()
        wait_until(lambda: answers_by_now(rt, "neighbour"), timeout=20, what="the neighbour healed")
        assert "dropping neighbour" not in rt.log()


def test_a_cancelled_load_in_a_pack_recycles_it_and_the_survivor_serves_on():
    with packed() as rt:
        rt.load("echo", rt.model_dir("echo"))
        (old,) = pack_pids(rt)
        expect_status(
            grpc.StatusCode.DEADLINE_EXCEEDED, rt.load, "slow", rt.model_dir("slow", SLOW_MODEL), timeout=0.5
        )
        rt.unload("slow")  # what model-mesh sends after a load it gave up on
        assert not psutil.pid_exists(old), "the pack that may still be loading it is reaped"
        assert answers(rt, "echo")
        assert old not in pack_pids(rt) and len(pack_pids(rt)) == 1


def test_a_load_that_runs_long_moves_the_packs_other_models_out_and_they_answer_meanwhile():
    with packed(METRICS_PORT=str(free_port())) as rt:
        echo_size = rt.load("echo", rt.model_dir("echo")).sizeInBytes
        (old,) = pack_pids(rt)
        gated = rt.model_dir("gated", GATED_MODEL)
        loading = rt.load_future("gated", gated)
        recycles = lambda: metric_sample(scrape_metrics(rt), "mesh_pack_recycle_seconds_count")  # noqa: E731
        wait_until(lambda: recycles() == 1, timeout=20, what="echo moved out while gated loads")
        assert pack_of(rt, "echo") != old and all(answers(rt, "echo") for _ in range(3))
        assert not loading.done() and "the load of gated" in rt.log()
        open(os.path.join(gated, "go"), "w").close()
        gated_size = loading.result(timeout=30).sizeInBytes
        # The old pack dropped its copy of echo before loadModel returned, and charges gated all its base.
        assert "models=1" in " ".join(psutil.Process(old).cmdline())
        assert pack_of(rt, "gated") == old and answers(rt, "gated") and gated_size > 2 * echo_size
        shown = inspected(rt)
        slow = {m["model"]: m["loads_slowly"] for m in shown["models"]}
        assert slow["gated"] and not slow["echo"]
        (gated_line,) = [line for line in cli.table(shown["workers"]).splitlines() if "- gated " in line]
        assert gated_line.endswith("(its load ran long)")
        rt.load("next", rt.model_dir("next"))
        assert pack_of(rt, "next") == pack_of(rt, "echo")  # the old pack takes no other model
        rt.unload("gated")
        assert not psutil.pid_exists(old) and answers(rt, "echo") and answers(rt, "next")


def test_a_pack_still_running_a_load_given_up_on_is_not_taken_for_hung_while_it_is_recycled():
    with packed(WORKER_HEARTBEAT_TIMEOUT_MS="300") as rt:
        lagging = rt.model_dir("lagging", SLOW_WHEN_TOLD_MODEL)
        rt.load("lagging", lagging)
        (old,) = pack_pids(rt)
        open(os.path.join(lagging, "slow"), "w").close()  # its move into a fresh pack takes 2 s
        expect_status(
            grpc.StatusCode.DEADLINE_EXCEEDED, rt.load, "slow", rt.model_dir("slow", SLOW_MODEL), timeout=0.5
        )
        rt.unload("slow")  # returns once the recycle that moves "lagging" is done
        # The old pack ran the abandoned load all along, beating not once: its kill is the recycle's.
        assert "hung" not in rt.log() and not psutil.pid_exists(old)
        (fresh,) = pack_pids(rt)
        assert answers(rt, "lagging")
        assert [m["model"] for m in pack_row(rt, fresh)["models"]] == ["lagging"]


def test_a_load_waiting_for_a_pack_whose_load_is_given_up_on_goes_to_another_pack():
    with packed(WORKERS_WARM="0") as rt:
        rt.load("first", rt.model_dir("first"))
        pool = concurrent.futures.ThreadPoolExecutor(2)
        slower = SLOW_MODEL.replace("time.sleep(3)", "time.sleep(8)")
        given_up = pool.submit(rt.load, "slow", rt.model_dir("slow", slower), timeout=1)
        wait_until(lambda: "loading slow" in rt.log(), timeout=5, what="the slow load under way")
        waiting = pool.submit(rt.load, "next", rt.model_dir("next"), timeout=5)  # behind it, in line
        with pytest.raises(grpc.RpcError):
            given_up.result()
        # The pack runs the abandoned load for seven more seconds: "next" goes elsewhere, not behind it.
        assert waiting.result().sizeInBytes > 0 and answers(rt, "next")
        rt.unload("slow")
        assert answers(rt, "first") and answers(rt, "next")


def test_a_pack_that_dies_while_its_models_move_out_leaves_each_of_them_in_one_pack_charged_once():
    with packed() as rt:
        lagging = rt.model_dir("lagging", SLOW_ONCE_MODEL)
        size = rt.load("lagging", lagging).sizeInBytes
        rt.load("leaky", rt.model_dir("leaky", LEAKY_MODEL))
        (old,) = pack_pids(rt)
        open(os.path.join(lagging, "slow"), "w").close()  # its move takes 2 s; a load after it, not
        unloading = concurrent.futures.ThreadPoolExecutor(1).submit(rt.unload, "leaky")  # a recycle
        wait_until(lambda: "recycling" in rt.log(), timeout=20, what="the recycle under way")
        os.kill(old, signal.SIGKILL)  # while "lagging" loads in the fresh pack
        unloading.result(timeout=30)
        assert answers(rt, "lagging")
        holding = [row for row in inspected(rt)["workers"] if row["role"] == "pack"]
        assert [[(m["model"], m["bytes"]) for m in row["models"]] for row in holding] == [[("lagging", size)]]


def test_a_model_still_loading_its_second_replica_moves_with_the_pack_of_its_first():
    with packed(MODEL_REPLICAS="2", WORKERS_WARM="2") as rt:
        rt.load("leaky", rt.model_dir("leaky", LEAKY_MODEL))  # two packs
        path = rt.model_dir("x", SLOW_AFTER_FIRST_MODEL)
        loading = concurrent.futures.ThreadPoolExecutor(1).submit(rt.load, "x", path)
        first = os.path.join(path, "loaded-once")
        wait_until(lambda: os.path.exists(first), timeout=10, what="x's first replica loaded")
        rt.unload("leaky")  # recycles the pack of x's first replica while its second loads
        assert loading.result(timeout=30).sizeInBytes > 0 and answers(rt, "x")
        rows = inspected(rt)["workers"]
        assert len([row for row in rows if any(m["model"] == "x" for m in row.get("models", []))]) == 2


@pytest.mark.parametrize("threads", ["1", "2"])
def test_an_unload_lets_the_pack_answer_the_models_calls_before_it_drops_the_model(threads):
    with packed(WORKER_THREADS=threads) as rt:
        rt.load("neighbour", rt.model_dir("neighbour"))
        rt.load("busy", rt.model_dir("busy", CLOSE_AFTER_CALLS_MODEL))
        call = concurrent.futures.ThreadPoolExecutor(1).submit(answers, rt, "busy")
        wait_until(lambda: busy_in(rt, "busy"), timeout=10, what="the call under way in the pack")
        rt.unload("busy")
        assert call.result(timeout=10), "the call ran to its end before the model was closed"
        assert answers(rt, "neighbour")


@pytest.mark.parametrize("threads", ["1", "2"])
def test_an_unload_waits_for_a_stuck_call_only_through_the_grace_and_the_pack_serves_on(threads):
    with packed(WORKER_THREADS=threads) as rt:
        rt.load("neighbour", rt.model_dir("neighbour"))
        rt.load("stuck", rt.model_dir("stuck", STUCK_CALL_MODEL))
        call = concurrent.futures.ThreadPoolExecutor(1).submit(answers, rt, "stuck")
        wait_until(lambda: busy_in(rt, "stuck"), timeout=10, what="the call under way in the pack")
        rt.unload("stuck")  # within its 60 s deadline: not held for the call's two minutes
        assert "calls of stuck ran on past its unload" in rt.log()
        with pytest.raises(grpc.RpcError):
            call.result(timeout=60)
        assert answers(rt, "neighbour")


def test_an_unload_of_a_packs_last_model_waits_for_a_stuck_call_only_through_the_grace():
    with packed() as rt:
        rt.load("stuck", rt.model_dir("stuck", STUCK_CALL_MODEL))
        call = concurrent.futures.ThreadPoolExecutor(1).submit(answers, rt, "stuck")
        wait_until(lambda: busy_in(rt, "stuck"), timeout=10, what="the call under way in the pack")
        started = time.monotonic()
        rt.unload("stuck")
        # The grace for its calls, then for its close(): as beside other models, or in a worker of its own.
        assert time.monotonic() - started < 2 * packs.CALLS_GRACE_SECONDS + 1
        with pytest.raises(grpc.RpcError):
            call.result(timeout=60)


# Writes "closed" in its folder as close() begins; with the file "hang" there, close() never ends.
CLOSING_MODEL = """
    import os, time

    class Model:
        def __init__(self, path):
            self.path = path

        def predict(self, inputs):
            return dict(inputs)

        def close(self):
            open(os.path.join(self.path, "closed"), "w").close()
            while os.path.exists(os.path.join(self.path, "hang")):
                time.sleep(0.1)
"""


def test_a_packed_models_close_that_never_ends_holds_its_unload_through_the_grace_only():
    with packed() as rt:
        rt.load("neighbour", rt.model_dir("neighbour"))
        path = rt.model_dir("hanging", CLOSING_MODEL)
        open(os.path.join(path, "hang"), "w").close()
        rt.load("hanging", path)
        rt.unload("hanging")  # within its 60 s deadline
        assert os.path.exists(os.path.join(path, "closed"))
        assert "the drop of hanging ran on past 2 s" in rt.log()
        assert answers(rt, "neighbour")


def test_a_first_model_whose_close_never_ends_loads_in_a_worker_of_its_own():
    with packed() as rt:
        path = rt.model_dir("hanging", CLOSING_MODEL)
        open(os.path.join(path, "hang"), "w").close()
        rt.load("hanging", path)  # a new pack's rehearsal drops it: its close() does not end
        assert "hanging failed to load in a pack (its close() did not end)" in rt.log()
        assert answers(rt, "hanging") and rt.worker_for("hanging") is not None  # a worker of its own


def test_the_last_model_of_a_pack_gets_its_close_too():
    with packed() as rt:
        paths = [rt.model_dir(model_id, CLOSING_MODEL) for model_id in ("first", "last")]
        for model_id, path in zip(("first", "last"), paths, strict=True):
            rt.load(model_id, path)
        for model_id, path in zip(("first", "last"), paths, strict=True):
            rt.unload(model_id)
            assert os.path.exists(os.path.join(path, "closed")), model_id


# Keeps an object of a class of its own pickled, and unpickles it for each call.
PICKLING_MODEL = """
    import pickle

    class Scale:
        factor = FACTOR

    class Model:
        def __init__(self, path):
            self.kept = pickle.dumps(Scale())

        def predict(self, inputs):
            return {"y": inputs["x"] * pickle.loads(self.kept).factor}
"""


def test_packed_models_each_find_their_own_classes_by_name():
    with packed() as rt:
        for model_id, factor in (("twice", "2.0"), ("thrice", "3.0")):
            rt.load(model_id, rt.model_dir(model_id, PICKLING_MODEL.replace("FACTOR", factor)))
        assert pack_of(rt, "twice") == pack_of(rt, "thrice")
        assert list(rt.infer_fp32("twice", [1.0]).outputs[0].contents.fp32_contents) == [2.0]
        rt.unload("thrice")
        assert list(rt.infer_fp32("twice", [1.0]).outputs[0].contents.fp32_contents) == [2.0]


# Holds an exclusive lock on a file of its folder for as long as it lives (a cache's, a database's):
# a second copy's load waits for the first one's end.
LOCKING_MODEL = """
    import fcntl, os

    class Model:
        def __init__(self, path):
            self.lock = open(os.path.join(path, "cache.lock"), "w")
            fcntl.flock(self.lock, fcntl.LOCK_EX)

        def predict(self, inputs):
            return dict(inputs)
"""


def test_a_survivor_that_cannot_load_beside_its_old_copy_heals_once_the_recycle_gives_it_up():
    with packed(LOADTIME_TIMEOUT="3000") as rt:
        rt.load("locker", rt.model_dir("locker", LOCKING_MODEL))
        rt.load("leaky", rt.model_dir("leaky", LEAKY_MODEL))
        rt.unload("leaky")  # recycles the pack: the fresh one's copy of locker waits for the lock
        assert "the survivors did not load in it in time" in rt.log()
        wait_until(lambda: answers_by_now(rt, "locker"), timeout=30, what="locker healed")


def test_a_recycle_whose_loads_take_longer_than_loadtime_timeout_in_all_moves_them_all():
    # Each load well within LOADTIME_TIMEOUT, all of them not.
    with packed(LOADTIME_TIMEOUT="1000", MODELS_PER_WORKER="6") as rt:
        slow = rt.model_dir(
            "slow", STUCK_CALL_MODEL.replace("pass", "time.sleep(0.3)").replace("(120)", "(0)")
        )
        for n in range(5):
            rt.load(f"s{n}", slow)
            assert answers(rt, f"s{n}")  # called: the next load may go beside it
        rt.load("leaky", rt.model_dir("leaky", LEAKY_MODEL))
        rt.unload("leaky")  # recycles the pack: 0.3 s for each survivor to load again, 1.5 s in all
        assert "5 models move" in rt.log() and "did not load in it in time" not in rt.log()
        assert all(answers(rt, f"s{n}") for n in range(5))


def test_a_model_that_cannot_load_beside_its_old_copy_is_given_up_by_a_compaction_and_heals():
    with packed(LOADTIME_TIMEOUT="3000") as rt:
        echo = rt.model_dir("echo")
        for n in range(4):
            rt.load(f"a{n}", echo)  # a full pack
        rt.load("locker", rt.model_dir("locker", LOCKING_MODEL))  # alone in another
        rt.unload("a0")  # compacts locker's pack into the first, whose copy waits for the lock
        assert "moving in, ran past LOADTIME_TIMEOUT" in rt.log()
        wait_until(lambda: answers_by_now(rt, "locker"), timeout=30, what="locker healed")
        assert all(answers(rt, f"a{n}") for n in range(1, 4))


def test_calls_queued_behind_a_stuck_call_go_where_their_model_moved_when_its_unload_recycles_the_pack():
    with packed() as rt:
        rt.load("neighbour", rt.model_dir("neighbour"))
        rt.load("stuck", rt.model_dir("stuck", STUCK_CALL_MODEL))
        callers = concurrent.futures.ThreadPoolExecutor(4)
        stuck_call = callers.submit(answers, rt, "stuck")
        wait_until(lambda: busy_in(rt, "stuck"), timeout=10, what="the call under way in the pack")
        queued = [callers.submit(answers, rt, "neighbour") for _ in range(3)]  # behind it, one thread
        rt.unload("stuck")
        assert all(call.result(timeout=30) for call in queued)
        with pytest.raises(grpc.RpcError):
            stuck_call.result(timeout=30)


# Registers itself process-wide as it is imported, as a module-level metric does, and refuses a
# second registration: a new pack loads its first model twice.
REGISTERING_MODEL = """
    import numpy as np

    if getattr(np, "_registered_by_test", False):
        raise ValueError("Duplicated timeseries in CollectorRegistry: {'my_model_calls_total'}")
    np._registered_by_test = True

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            return dict(inputs)
"""


def test_a_model_that_fails_to_load_in_a_pack_loads_in_a_worker_of_its_own():
    with packed() as rt:
        assert rt.load("metered", rt.model_dir("metered", REGISTERING_MODEL)).sizeInBytes > 0
        assert "metered failed to load in a pack (ValueError: Duplicated timeseries" in rt.log()
        assert answers(rt, "metered") and rt.worker_for("metered").pid not in [p.pid for p in rt.packs()]


def test_a_quick_load_queued_behind_a_busy_packs_calls_is_not_taken_for_a_slow_one():
    with packed() as rt:
        busy = rt.model_dir("busy", STUCK_CALL_MODEL.replace("time.sleep(120)", "time.sleep(0.3)"))
        models = ("b1", "b2", "b3")
        for model_id in models:
            rt.load(model_id, busy)
            assert answers(rt, model_id)  # called: the next load may go beside it
        pack = pack_of(rt, "b1")
        callers = concurrent.futures.ThreadPoolExecutor(9)
        # Three of each in the pack (one thread, two more in its pipeline): 2.7 s of calls ahead,
        # past the wait for calls ahead that answer none (AHEAD_WAIT_MAX_SECONDS), each 0.3 s.
        calls = [callers.submit(answers, rt, model_id) for model_id in models * 3]
        wait_until(lambda: all(busy_in(rt, m) for m in models), timeout=10, what="calls under way")
        rt.load("quick", rt.model_dir("quick"))
        assert all(call.result(timeout=30) for call in calls)
        assert pack_of(rt, "quick") == pack == pack_of(rt, "b1") and "runs long" not in rt.log()


def test_a_memory_limit_holds_a_pack_to_what_its_models_are_charged_and_the_limit_beyond():
    limit = 24 * MiB
    with packed(WORKER_MEMORY_LIMIT_BYTES=str(limit), MODEL_PACK_MAX_BYTES=str(16 * MiB)) as rt:
        for n in range(4):  # 6 MiB each: together past the limit, each far below it
            rt.load(f"m{n}", rt.model_dir(f"m{n}", allocating_model(6)))
            assert rt.infer_fp32(f"m{n}", [1.0]).outputs  # called: the next load may go beside it
        pack = pack_of(rt, "m0")
        assert all(pack_of(rt, f"m{n}") == pack for n in range(4))
        assert psutil.Process(pack).memory_full_info().uss > limit
        time.sleep(1.5)  # three of the watchdog's looks
        assert all(rt.infer_fp32(f"m{n}", [1.0]).outputs for n in range(4)) and pack_of(rt, "m0") == pack
        assert "over WORKER_MEMORY_LIMIT_BYTES" not in rt.log()


def test_a_load_behind_a_call_that_never_ends_still_moves_the_packs_other_models_out():
    with packed(LOADTIME_TIMEOUT="15000") as rt:
        rt.load("neighbour", rt.model_dir("neighbour"))
        # Its call runs past the 2.5 s after which the others move, as if it never ended.
        rt.load("stuck", rt.model_dir("stuck", STUCK_CALL_MODEL.replace("(120)", "(5)")))
        concurrent.futures.ThreadPoolExecutor(1).submit(answers, rt, "stuck")
        wait_until(lambda: busy_in(rt, "stuck"), timeout=10, what="the call under way in the pack")
        old = pack_of(rt, "neighbour")
        loading = rt.load_future("new", rt.model_dir("new"))
        wait_until(
            lambda: only_pack_of(rt, "neighbour") not in (None, old),
            timeout=10,
            what="the pack's other models moved",
        )
        assert answers(rt, "neighbour") and "runs long" in rt.log()
        loading.cancel()


def test_a_model_that_outgrows_its_pack_gets_a_worker_of_its_own():
    with packed(MODEL_PACK_MAX_BYTES=str(4 * MiB)) as rt:
        rt.load("echo", rt.model_dir("echo"))
        size = rt.load("big", rt.model_dir("big", allocating_model(16))).sizeInBytes
        assert size > 16 * MiB
        assert rt.worker_for("big") is not None, "big runs in a worker of its own"
        assert len(pack_pids(rt)) == 1 and answers(rt, "echo")
        assert "over MODEL_PACK_MAX_BYTES" in rt.log()


# A model that calls sys.exit() where a model may run code: its constructor when told to, predict;
# or, told to, raises another exception that is not an Exception.
EXITING_MODEL = """
    import asyncio, os, sys

    class Model:
        def __init__(self, path):
            self.path = path
            if os.path.exists(os.path.join(path, "exit-at-load")):
                sys.exit(3)

        def predict(self, inputs):
            if os.path.exists(os.path.join(self.path, "cancelled")):
                raise asyncio.CancelledError("by the model")
            sys.exit(4)
"""


def test_a_packed_model_whose_code_raises_or_exits_fails_only_its_own_call_or_load():
    with packed() as rt:
        rt.load("echo", rt.model_dir("echo"))
        rt.load("raising", rt.model_dir("raising", RAISING_MODEL))
        (pid,) = pack_pids(rt)
        error = expect_status(grpc.StatusCode.INTERNAL, rt.infer_fp32, "raising", [1.0])
        assert "cannot digest" in error.details(), error.details()
        rt.load("exiting", rt.model_dir("exiting", EXITING_MODEL))
        error = expect_status(grpc.StatusCode.INTERNAL, rt.infer_fp32, "exiting", [1.0])
        assert "SystemExit: 4" in error.details(), error.details()
        folder = rt.model_dir("exiting-load", EXITING_MODEL)
        open(os.path.join(folder, "exit-at-load"), "w").close()
        error = expect_status(grpc.StatusCode.FAILED_PRECONDITION, rt.load, "exiting-load", folder)
        assert "SystemExit: 3" in error.details(), error.details()
        folder = rt.model_dir("cancelling", EXITING_MODEL)
        open(os.path.join(folder, "cancelled"), "w").close()
        rt.load("cancelling", folder)
        error = expect_status(grpc.StatusCode.INTERNAL, rt.infer_fp32, "cancelling", [1.0])
        assert "CancelledError: by the model" in error.details(), error.details()
        assert answers(rt, "echo") and pack_pids(rt) == {pid}, "the pack and its other model serve on"


def test_a_packed_model_serves_the_concurrency_loadmodel_reports():
    with packed(WORKER_THREADS="2", LIMIT_MODEL_CONCURRENCY="true") as rt:
        rt.load("echo", rt.model_dir("echo"))
        answer = rt.load("meeting", rt.model_dir("meeting", MEETING_MODEL))
        assert answer.maxConcurrency == 2 and len(pack_pids(rt)) == 1
        with concurrent.futures.ThreadPoolExecutor(2) as callers:
            calls = [callers.submit(answers, rt, "meeting") for _ in range(2)]
            assert all(call.result(timeout=20) for call in calls), "two calls ran at once in the pack"


@pytest.mark.parametrize("signum", [signal.SIGKILL])
def test_a_pack_killed_from_outside_heals_every_model_in_it(signum):
    with packed() as rt:
        for i in range(3):
            rt.load(f"m{i}", rt.model_dir(f"m{i}"))
        (pid,) = pack_pids(rt)
        os.kill(pid, signum)
        wait_until(
            lambda: pid not in pack_pids(rt) and len(pack_pids(rt)) == 1, timeout=20, what="a new pack"
        )
        wait_until(lambda: all(answers(rt, f"m{i}") for i in range(3)), timeout=20, what="all healed")


def test_the_models_of_killed_packs_heal_into_as_few_packs_as_hold_them():
    # Healing reloads them all at once, spread over the packs with room and new ones; the packs
    # left part-empty are compacted, so no pack's base goes uncovered by its models' sizes.
    with packed() as rt:
        for i in range(14):
            rt.load(f"m{i}", rt.model_dir(f"m{i}"))
        full = [row["pid"] for row in inspected(rt)["workers"] if len(row.get("models", [])) == 4]
        for pid in full:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: all(answers_by_now(rt, f"m{i}") for i in range(14)), timeout=20, what="all healed")
        wait_until(lambda: len(pack_pids(rt)) == 4, timeout=20, what="fourteen models in four packs of four")
        held = sorted(len(row["models"]) for row in inspected(rt)["workers"] if row["role"] == "pack")
        assert sum(held) == 14 and all(answers(rt, f"m{i}") for i in range(14)), held
        assert len(full) == 3 and "compacted:" in rt.log(), "the heals were left in more packs at first"


def test_inspect_workers_shows_each_pack_with_its_models_and_their_sizes():
    with packed() as rt:
        sizes = {f"m{i}": rt.load(f"m{i}", rt.model_dir(f"m{i}")).sizeInBytes for i in range(3)}
        by_script = subprocess.run([*inspect_command(rt), "--json"], capture_output=True, text=True).stdout
        (pack,) = [row for row in json.loads(by_script)["workers"] if row["role"] == "pack"]
        assert pack["model"] == "3 models"
        shown_sizes = {m["model"]: m["bytes"] for m in pack["models"]}
        assert shown_sizes.keys() == sizes.keys()
        assert shown_sizes["m1"] == sizes["m1"] and shown_sizes["m2"] == sizes["m2"]
        # The first load also paid the pack's first-use costs, which moved to the pack's base.
        assert 0 < shown_sizes["m0"] <= sizes["m0"]
        shown = subprocess.run(inspect_command(rt), capture_output=True, text=True).stdout
        assert all(f"- m{i} " in shown for i in range(3)), shown


def test_the_replicas_of_a_packed_model_go_to_different_packs():
    with packed(MODEL_REPLICAS="2") as rt:
        size = rt.load("twice", rt.model_dir("twice")).sizeInBytes
        assert len(pack_pids(rt)) == 2, "one replica per pack"
        assert size > 0 and answers(rt, "twice")
        rt.unload("twice")
        assert not pack_pids(rt)


def test_calls_to_the_survivors_of_a_recycle_all_succeed():
    with packed() as rt:
        for model_id in ("a", "b"):
            rt.load(model_id, rt.model_dir(model_id))
        rt.load("leaky", rt.model_dir("leaky", LEAKY_MODEL))
        (old,) = pack_pids(rt)
        outcomes: list[bool] = []
        stop = threading.Event()

        def call_the_survivors() -> None:
            while not stop.is_set():
                outcomes.extend(answers(rt, model_id) for model_id in ("a", "b"))

        caller = threading.Thread(target=call_the_survivors)
        caller.start()
        try:
            wait_until(lambda: len(outcomes) > 20, what="calls flowing")
            rt.unload("leaky")
            calls_before = len(outcomes)
            wait_until(lambda: len(outcomes) > calls_before + 20, what="calls after the recycle")
        finally:
            stop.set()
            caller.join()
        assert old not in pack_pids(rt) and "recycling" in rt.log()
        assert all(outcomes), f"{outcomes.count(False)} of {len(outcomes)} calls failed"


def test_packs_that_unloads_left_half_empty_are_compacted_and_every_model_answers_on():
    with packed(METRICS_PORT=str(free_port())) as rt:
        for i in range(8):
            rt.load(f"m{i}", rt.model_dir(f"m{i}"))
        first, second = sorted(pack_pids(rt))  # four models each
        for i in (0, 1, 4):
            rt.unload(f"m{i}")
        assert pack_pids(rt) == {first, second}, "three free places do not hold either pack's models"
        rt.unload("m5")  # now either pack's two models fit into the other's two free places
        (kept,) = pack_pids(rt)
        gone = first if kept == second else second
        assert not psutil.pid_exists(gone), "the emptied pack is reaped before unloadModel returns"
        assert all(answers(rt, f"m{i}") for i in (2, 3, 6, 7))
        assert "compacted: 2 of its 2 models moved" in rt.log()
        assert metric_sample(scrape_metrics(rt), "mesh_pack_models_moved_total") == 2
        # What the moved models were charged moved with them.
        (pack,) = [row for row in inspected(rt)["workers"] if row["role"] == "pack"]
        assert sorted(m["model"] for m in pack["models"]) == ["m2", "m3", "m6", "m7"]
        assert all(m["bytes"] > 0 for m in pack["models"])


def test_capacity_holds_back_the_base_of_one_open_pack_per_format():
    memory = {"CONTAINER_MEM_REQ_BYTES": str(4096 * MiB), "WORKERS_WARM": "1"}
    with Runtime(**memory) as alone:
        without_packs = alone.status.capacityInBytes
    with Runtime(**memory, MODELS_PER_WORKER="32") as rt:
        with_packs = rt.status.capacityInBytes
    # Python models only go into packs here (WORKER_PRELOAD=numpy): two packs not yet full, the
    # base of each (two spares' cost, a spare about 4 MiB) counted in capacity.
    assert without_packs - with_packs > 12 * MiB, (without_packs, with_packs)


@pytest.mark.parametrize("replicas", [1, 3])
def test_with_no_warm_spares_the_fork_servers_run_and_packs_are_held_back_from_the_start(replicas):
    memory = {"CONTAINER_MEM_REQ_BYTES": str(4096 * MiB), "MODELS_PER_WORKER": "32"}
    with Runtime(**memory, WORKERS_WARM="0", MODEL_REPLICAS=str(replicas)) as rt:
        servers = rt.forkservers()
        assert servers, "running before any load, so capacity counts them"
        assert all(imported(server.pid, "numpy") for server in servers), "their preload done by then"
        assert rt.spares() == []
        held = cli.ask(rt.env["RUNTIME_DIR"], "pool")["held_for_open_packs_bytes"]
    # No spare to measure: python's packs (numpy preloaded) held back at the base packs predict,
    # two of them open, or one per replica (each replica goes into another pack).
    base = formats.by_name("python").size_floor * packs.PREDICTED_BASE_PER_FLOOR
    assert held == base * max(packs.FILLING_PACKS_MAX, replicas)


def test_a_small_model_whose_framework_is_not_preloaded_gets_a_worker_of_its_own():
    import joblib
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    with packed() as rt:  # WORKER_PRELOAD=numpy
        folder = os.path.join(rt.models, "iris")
        os.makedirs(folder)
        joblib.dump(
            LogisticRegression(max_iter=500).fit(*load_iris(return_X_y=True)), f"{folder}/model.joblib"
        )
        rt.load("iris", folder, fmt="sklearn")
        assert pack_pids(rt) == set() and rt.worker_for("iris") is not None


# Imports its helper module inside predict(), not at its load.
HELPED_MODEL = """
import numpy as np

class Model:
    def __init__(self, path):
        pass

    def predict(self, inputs):
        import helpers
        return {"who": np.array([helpers.WHO])}
"""


def test_custom_models_with_modules_of_their_own_get_workers_of_their_own_and_run_their_own_code():
    with packed() as rt:
        rt.load("plain", rt.model_dir("plain"))
        for name in ("tenant-a", "tenant-b"):
            folder = rt.model_dir(name, HELPED_MODEL)
            with open(os.path.join(folder, "helpers.py"), "w") as helpers:
                helpers.write(f"WHO = {name!r}\n")
            rt.load(name, folder)
        for name in ("tenant-a", "tenant-b", "tenant-a"):
            assert rt.infer_fp32(name, [1.0]).outputs[0].contents.bytes_contents == [name.encode()]
        assert pack_of(rt, "plain") in pack_pids(rt)  # a model with no modules beside it is packed
        assert rt.worker_for("tenant-a") is not None and rt.worker_for("tenant-b") is not None


def imported(pid: int, package: str) -> bool:
    """Whether the process maps a file of `package` (its compiled modules: imported)."""
    with open(f"/proc/{pid}/maps") as maps:
        return f"/{package}/" in maps.read()


def pack_of(rt: Runtime, model_id: str) -> int:
    """The pid of the pack that holds the model (inspect-workers)."""
    (pid,) = packs_of(rt, model_id)
    return pid


def packs_of(rt: Runtime, model_id: str) -> list[int]:
    """The pids of the packs that hold the model: none while it heals, two while it moves."""
    return [
        row["pid"]
        for row in inspected(rt)["workers"]
        if row["role"] == "pack" and model_id in {m["model"] for m in row["models"]}
    ]


def only_pack_of(rt: Runtime, model_id: str) -> int | None:
    """pack_of() for a wait: None while the model is in no pack or in two."""
    held = packs_of(rt, model_id)
    return held[0] if len(held) == 1 else None


def one_pack_holds(rt: Runtime, first: str, second: str) -> bool:
    """Whether both models are in one pack and no other (not while either heals or moves)."""
    pid = only_pack_of(rt, first)
    return pid is not None and only_pack_of(rt, second) == pid


def test_a_load_neither_queues_behind_another_nor_goes_where_a_first_call_is_due():
    with packed(WORKERS_WARM="2") as rt:
        rt.load("first", rt.model_dir("first"))
        (first_pack,) = pack_pids(rt)
        wait_until(lambda: len(alive(rt.spares())) == 2, timeout=30, what="two spares")
        slow = rt.load_future("slow", rt.model_dir("slow", SLOW_MODEL))
        wait_until(
            lambda: any("models=2" in " ".join(p.cmdline()) for p in alive(rt.packs())),
            what="the slow load to start in the first pack",
        )
        rt.load("quick", rt.model_dir("quick"))
        assert not slow.done(), "the quick load did not wait for the slow one"
        assert pack_of(rt, "quick") != pack_of(rt, "first")
        slow.result(timeout=30)
        assert pack_of(rt, "slow") == first_pack  # and "first" moved out while it loaded
        assert answers(rt, "quick")
        rt.load("third", rt.model_dir("third"))
        assert pack_of(rt, "third") != first_pack  # left to the slow model
        assert all(answers(rt, m) for m in ("first", "slow", "quick", "third"))


def test_a_pack_whose_models_have_replicas_in_the_others_is_not_compacted():
    # Each model's two replicas are in the two packs: neither pack's models can move into the other.
    with packed(MODEL_REPLICAS="2") as rt:
        for i in range(3):
            rt.load(f"m{i}", rt.model_dir(f"m{i}"))
        first, second = sorted(pack_pids(rt))
        rt.unload("m2")  # three free places in all, but every model already has a replica beside them
        assert pack_pids(rt) == {first, second} and "compacted" not in rt.log()
        assert all(answers(rt, f"m{i}") for i in range(2))


def test_a_pack_that_loads_at_idle_priority_is_recycled_with_its_survivors_loaded_at_once():
    pytest.importorskip("sklearn", reason="pip install 'mesh-runtime[sklearn]'")
    import joblib
    from parking_estimator import ParkingEstimator

    tests = os.path.dirname(os.path.abspath(__file__))
    with packed(WORKER_PRELOAD="numpy,sklearn", PYTHONPATH=tests) as rt:

        def estimator(model_id: str, park_bytes: int) -> str:
            folder = os.path.join(rt.models, model_id)
            os.makedirs(folder)
            joblib.dump(ParkingEstimator(park_bytes), os.path.join(folder, "model.joblib"))
            return folder

        for model_id in ("a", "b", "c"):
            rt.load(model_id, estimator(model_id, 0), fmt="sklearn")
        rt.load("parking", estimator("parking", 8 * MiB), fmt="sklearn")
        (old,) = pack_pids(rt)
        rt.unload("parking")
        (fresh,) = pack_pids(rt)
        assert fresh != old and not psutil.pid_exists(old) and "recycling" in rt.log()
        assert all(rt.infer_fp32(m, [[2.5]]).outputs for m in ("a", "b", "c")), "the survivors moved"
        # Each survivor is judged by what it added in its old pack: its unload recycles nothing.
        rt.unload("a")
        assert pack_pids(rt) == {fresh} and rt.log().count("recycling") == 1


def test_a_recycle_runs_to_its_end_though_the_load_that_set_it_off_is_cancelled():
    with packed() as rt:
        lagging = rt.model_dir("lagging", SLOW_WHEN_TOLD_MODEL)
        rt.load("lagging", lagging)
        (old,) = pack_pids(rt)
        open(os.path.join(lagging, "slow"), "w").close()  # its move into a fresh pack takes 2 s
        failing = concurrent.futures.ThreadPoolExecutor(1).submit(
            rt.load, "failing", rt.model_dir("failing", FAILING_LEAKY_MODEL)
        )
        wait_until(lambda: "recycling" in rt.log(), timeout=20, what="the failed load's recycle")
        rt.unload("failing")  # cancels the load, which is waiting for the recycle: returns once it is done
        assert not psutil.pid_exists(old), "the old pack is killed and reaped by then"
        with pytest.raises(grpc.RpcError):
            failing.result(timeout=30)
        (fresh,) = pack_pids(rt)  # not a fresh pack half made beside the old one
        assert fresh != old and answers(rt, "lagging")
        rt.unload("lagging")
        wait_until(lambda: not pack_pids(rt), timeout=20, what="its pack ended with its last model")


def test_work_run_to_the_end_finishes_and_its_caller_is_cancelled_after_it(caplog):
    import asyncio

    from runtime.tasks import to_the_end

    steps = []

    async def work(fail: bool = False):
        steps.append("started")
        await asyncio.sleep(0.2)
        steps.append("finished")
        if fail:
            raise RuntimeError("the move failed")
        return 7

    async def cancelled_twice(fail: bool):
        caller = asyncio.ensure_future(to_the_end(work(fail)))
        await asyncio.sleep(0.05)
        caller.cancel()
        await asyncio.sleep(0.05)
        assert not caller.done(), "the caller waits for the work"
        caller.cancel()  # cancelled again meanwhile: still waits
        with pytest.raises(asyncio.CancelledError):
            await caller

    async def timed_out():
        async with asyncio.timeout(0.05):
            await to_the_end(work())

    async def main():
        await cancelled_twice(fail=False)
        assert steps == ["started", "finished"]
        await cancelled_twice(fail=True)  # the caller sees its cancellation, the error is logged
        assert "the move failed" in caplog.text
        with pytest.raises(TimeoutError):  # a deadline passed meanwhile: after the work
            await timed_out()
        assert steps[-1] == "finished"
        assert await to_the_end(work()) == 7
        with pytest.raises(RuntimeError):
            await to_the_end(work(fail=True))

    asyncio.run(main())
