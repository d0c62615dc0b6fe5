"""mmesh.ModelRuntime, driven the way model-mesh drives it (contract doc sections 1-3)."""

import json
import os
import signal
import threading
import time

import grpc
import pytest
from harness import (
    ECHO_MODEL,
    MiB,
    Runtime,
    alive,
    allocating_model,
    expect_status,
    status_of,
    tree,
    wait_until,
    write_model,
)

from protos import model_runtime_pb2 as mm

# Blocks in its constructor until a file named "go" appears in its folder.
GATED_MODEL = """
    import os, time

    class Model:
        def __init__(self, path):
            while not os.path.exists(os.path.join(path, "go")):
                time.sleep(0.01)

        def predict(self, inputs):
            return inputs
"""


# -- runtimeStatus -------------------------------------------------------------------


def test_runtime_status_ready_fields_pass_mesh_validation(rt):
    status = rt.mesh.runtimeStatus(mm.RuntimeStatusRequest())
    assert status.status == mm.RuntimeStatusResponse.READY
    assert status.maxLoadingConcurrency >= 1
    assert status.modelLoadingTimeoutMs == 5000
    assert (status.defaultModelSizeInBytes + 8191) // 8192 >= 1
    default = status.defaultModelSizeInBytes
    assert status.capacityInBytes >= max(2 * default, min(512 * MiB, 10 * default))
    assert status.runtimeVersion
    assert {name: list(info.idInjectionPath) for name, info in status.methodInfos.items()} == {
        "inference.GRPCInferenceService/ModelInfer": [1],
        "inference.GRPCInferenceService/ModelMetadata": [1],
        "inference.GRPCInferenceService/ModelReady": [1],
    }
    assert not status.allowAnyMethod and not status.limitModelConcurrency


def test_capacity_is_container_memory_minus_buffer_and_overhead():
    with Runtime(CONTAINER_MEM_REQ_BYTES=str(4 * 1024 * MiB), MEM_BUFFER_BYTES=str(256 * MiB)) as runtime:
        capacity = runtime.status.capacityInBytes
        # The overhead is what the front, fork server and spare occupy: their
        # PSS (shared framework pages counted once), measured here from outside.
        overhead = sum(p.memory_full_info().pss for p in alive(tree(runtime.pid)))
        expected = 4 * 1024 * MiB - 256 * MiB - overhead
        assert abs(capacity - expected) < 20 * MiB, (capacity, expected)


def test_capacity_is_read_once_the_fork_servers_and_spares_are_back():
    # model-mesh reads capacityInBytes once: counted while a fork server was dead, it left out
    # what the fork server and its spares cost, by tens of MiB.
    with Runtime(CONTAINER_MEM_REQ_BYTES=str(2 * 1024 * MiB), WORKERS_WARM="2") as runtime:
        settled = runtime.status.capacityInBytes
        for forkserver in runtime.forkservers():
            forkserver.send_signal(signal.SIGKILL)
        time.sleep(0.05)  # model-mesh asks a moment later, the kill done (as a review did)
        answer = runtime.mesh.runtimeStatus(mm.RuntimeStatusRequest(), timeout=30)
        assert answer.status == mm.RuntimeStatusResponse.READY
        assert abs(answer.capacityInBytes - settled) < 4 * MiB, (answer.capacityInBytes, settled)


@pytest.mark.parametrize("settings", [{"WORKERS_WARM": "2", "WORKERS_MAX": "1"}], ids=["fewer-than-warm"])
def test_ready_when_the_cap_allows_fewer_spares_than_warm(settings):
    # The spares the cap forbids never come: waiting for them, it would answer STARTING for ever.
    with Runtime(**settings) as runtime:
        answer = runtime.mesh.runtimeStatus(mm.RuntimeStatusRequest(), timeout=30)
        assert answer.status == mm.RuntimeStatusResponse.READY
        assert "answering STARTING" not in runtime.log()


def test_capacity_too_small_for_mesh_answers_failing():
    # Mesh refuses capacity below min(512 MiB, 10 x the default size).
    runtime = Runtime(CONTAINER_MEM_REQ_BYTES=str(300 * MiB), DEFAULT_MODELSIZE=str(100 * MiB))
    runtime.start(wait_ready=False)
    try:

        def answer():
            try:
                return runtime.mesh.runtimeStatus(mm.RuntimeStatusRequest(), timeout=5).status
            except grpc.RpcError:
                return None

        assert wait_until(
            lambda: answer() == mm.RuntimeStatusResponse.FAILING, timeout=30, what="runtimeStatus FAILING"
        )
    finally:
        runtime.stop()


def test_starting_until_the_pool_is_ready(tmp_path):
    # tests/slow_import_for_tests.py holds its import in the fork server until the gate file
    # exists, which holds the pool (and so READY) back while the server already answers.
    gate = tmp_path / "import-gate"
    runtime = Runtime(
        WORKER_PRELOAD="numpy,slow_import_for_tests",
        PYTHONPATH=os.path.dirname(__file__),
        MESH_TEST_IMPORT_GATE=str(gate),
    )
    runtime.start(wait_ready=False)
    try:
        first = wait_until(lambda: _status_answer(runtime), timeout=30, what="a runtimeStatus answer")
        assert first == ("answer", mm.RuntimeStatusResponse.STARTING)
        assert _status_answer(runtime) == ("answer", mm.RuntimeStatusResponse.STARTING)
        gate.touch()
        runtime.wait_ready()
    finally:
        gate.touch()
        runtime.stop()


def _status_answer(runtime):
    try:
        return ("answer", runtime.mesh.runtimeStatus(mm.RuntimeStatusRequest(), timeout=5).status)
    except grpc.RpcError:
        return None


def test_restart_purge_unloads_everything_before_ready(rt):
    rt.load("purge-a", rt.model_dir("purge-a"))
    worker = rt.worker_for("purge-a")
    status = rt.mesh.runtimeStatus(mm.RuntimeStatusRequest())
    assert status.status == mm.RuntimeStatusResponse.READY
    assert not worker.is_running() or worker.status() == "zombie"
    expect_status(grpc.StatusCode.NOT_FOUND, rt.infer_fp32, "purge-a", [1.0])
    rt.unload("purge-a")


# -- loadModel -------------------------------------------------------------------------


def test_load_infer_unload(rt):
    path = rt.model_dir("echo")
    response = rt.load("echo__isvc-0123456789", path)
    assert response.sizeInBytes > 0
    worker = rt.worker_for("echo__isvc-0123456789")
    assert worker is not None, "worker title names its model"
    assert rt.mesh.modelSize(mm.ModelSizeRequest(modelId="echo__isvc-0123456789")).sizeInBytes > 0
    answer = rt.infer_fp32("echo__isvc-0123456789", [[1.5, 2.5]])
    assert list(answer.outputs[0].contents.fp32_contents) == [1.5, 2.5]
    rt.unload("echo__isvc-0123456789")
    assert not worker.is_running()  # gone and reaped by the time unload returned
    expect_status(grpc.StatusCode.NOT_FOUND, rt.infer_fp32, "echo__isvc-0123456789", [1.0])


def test_format_from_model_type_and_from_files(rt):
    path = rt.model_dir("by-type")
    rt.load("by-type", path, model_type="mt:python:3", fmt=None)
    rt.load("by-files", path, model_type="rt:mesh-runtime", fmt=None)
    assert rt.infer_fp32("by-files", [1.0]).outputs[0].name == "x"
    rt.unload("by-type")
    rt.unload("by-files")


def test_load_is_idempotent(rt):
    path = rt.model_dir("twice")
    first = rt.load("twice", path)
    second = rt.load("twice", path)
    assert second.sizeInBytes == first.sizeInBytes
    assert rt.model_workers() == 1
    rt.unload("twice")


def test_model_path_may_be_the_model_file(rt):
    path = rt.model_dir("as-file")
    rt.load("as-file", os.path.join(path, "model.py"))
    rt.unload("as-file")


def test_relative_model_path_is_inside_root(rt):
    rt.model_dir("relative")
    rt.load("relative", "relative")
    rt.unload("relative")


def test_symlink_into_pvc_mounts_loads(rt):
    target = write_model(os.path.join(rt.pvc, "claim", "model"), ECHO_MODEL)
    os.makedirs(os.path.join(rt.models, "pvc-model"), exist_ok=True)
    link = os.path.join(rt.models, "pvc-model", "model")
    os.symlink(target, link)
    rt.load("pvc-model", link)
    rt.unload("pvc-model")


def _assert_refused_cleanly(rt, model_id, path, expected, words, model_type="", fmt="python", key=None):
    before = {p.pid for p in rt.workers()}
    request = mm.LoadModelRequest(
        modelId=model_id,
        modelType=model_type,
        modelPath=path,
        modelKey=key if key is not None else json.dumps({"model_type": {"name": fmt}}),
    )
    error = expect_status(expected, rt.mesh.loadModel, request, timeout=60)
    assert words in error.details()
    assert "not found" not in error.details().lower()
    assert rt.model_workers() == 0
    # Mesh sends unloadModel about 1 s after any failed load; it must succeed.
    rt.unload(model_id)
    return before


def test_missing_path(rt):
    _assert_refused_cleanly(
        rt, "missing", os.path.join(rt.models, "nope"), grpc.StatusCode.FAILED_PRECONDITION, "does not exist"
    )


def test_path_escaping_root_with_dotdot(rt):
    write_model(os.path.join(rt.root, "outside"), ECHO_MODEL)
    _assert_refused_cleanly(
        rt,
        "escape",
        os.path.join(rt.models, "..", "outside"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "outside ROOT_MODEL_DIR",
    )


def test_symlink_to_a_folder_outside_both_roots(rt):
    outside = write_model(os.path.join(rt.root, "elsewhere"), ECHO_MODEL)
    link = os.path.join(rt.models, "evil-link")
    os.symlink(outside, link)
    _assert_refused_cleanly(rt, "evil", link, grpc.StatusCode.INVALID_ARGUMENT, "symlink")


def test_symlinked_file_inside_model_folder_leading_outside(rt):
    outside = write_model(os.path.join(rt.root, "elsewhere-file"), ECHO_MODEL)
    folder = os.path.join(rt.models, "sneaky")
    os.makedirs(folder)
    os.symlink(os.path.join(outside, "model.py"), os.path.join(folder, "model.py"))
    _assert_refused_cleanly(rt, "sneaky", folder, grpc.StatusCode.INVALID_ARGUMENT, "symlink")


def test_unknown_format(rt):
    _assert_refused_cleanly(
        rt,
        "unknown-format",
        rt.model_dir("uf"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "unknown model format",
        fmt="tensorflow-9000",
    )


def test_format_not_recognisable_from_files(rt):
    folder = os.path.join(rt.models, "no-format")
    os.makedirs(folder)
    open(os.path.join(folder, "weights.bin"), "wb").close()
    _assert_refused_cleanly(
        rt, "no-format", folder, grpc.StatusCode.INVALID_ARGUMENT, "cannot tell the model format", key=""
    )


def test_model_key_not_json(rt):
    _assert_refused_cleanly(
        rt,
        "bad-key",
        rt.model_dir("bk"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "not valid JSON",
        key="{model_type:",
    )


def test_empty_model_id(rt):
    _assert_refused_cleanly(
        rt, "", rt.model_dir("no-id"), grpc.StatusCode.INVALID_ARGUMENT, "modelId is empty"
    )


def test_model_that_raises_while_loading(rt):
    path = rt.model_dir(
        "raises",
        """
        class Model:
            def __init__(self, path):
                raise RuntimeError("weights are corrupt")
    """,
    )
    before = rt.settled_uss()
    _assert_refused_cleanly(rt, "raises", path, grpc.StatusCode.FAILED_PRECONDITION, "weights are corrupt")
    assert abs(rt.settled_uss() - before) < 2 * MiB


def test_model_with_a_syntax_error(rt):
    path = rt.model_dir("syntax", "class Model(:\n    pass\n")
    _assert_refused_cleanly(rt, "syntax", path, grpc.StatusCode.FAILED_PRECONDITION, "SyntaxError")


def test_model_py_without_model_class(rt):
    path = rt.model_dir("no-class", "x = 1\n")
    _assert_refused_cleanly(rt, "no-class", path, grpc.StatusCode.FAILED_PRECONDITION, "no class Model")


def test_worker_dying_during_load(rt):
    path = rt.model_dir(
        "dies",
        """
        import os
        class Model:
            def __init__(self, path):
                os._exit(3)
    """,
    )
    _assert_refused_cleanly(rt, "dies", path, grpc.StatusCode.FAILED_PRECONDITION, "exit code 3")


@pytest.mark.slow  # waits out LOADTIME_TIMEOUT
def test_load_timeout_enforced_by_the_runtime(rt):
    # The shared runtime has LOADTIME_TIMEOUT=5000; this model sleeps 60 s.
    path = rt.model_dir("sleepy", allocating_model(1, sleep_s=60))
    open(os.path.join(path, "slow"), "w").close()
    error = expect_status(grpc.StatusCode.DEADLINE_EXCEEDED, rt.load, "sleepy", path, timeout=None)
    assert "LOADTIME_TIMEOUT" in error.details()
    assert rt.worker_for("sleepy") is None and rt.model_workers() == 0
    rt.unload("sleepy")


def test_loads_beyond_max_loading_concurrency_wait_their_turn(rt):
    paths = [rt.model_dir(f"gated-{i}", GATED_MODEL) for i in range(3)]
    futures = [rt.load_future(f"gated-{i}", path) for i, path in enumerate(paths)]
    wait_until(lambda: rt.model_workers() == 2, what="two loads to start")
    time.sleep(0.5)
    assert rt.model_workers() == 2, "MAX_LOADING_CONCURRENCY=2 lets a third load start"
    for path in paths:
        open(os.path.join(path, "go"), "w").close()
    for future in futures:
        assert future.result(timeout=30).sizeInBytes > 0
    for i in range(3):
        rt.unload(f"gated-{i}")


# -- unloadModel, modelSize, predictModelSize ----------------------------------------------


def test_unload_unknown_model_is_ok(rt):
    rt.unload("never-loaded")


def test_model_size_unknown_is_not_found(rt):
    expect_status(grpc.StatusCode.NOT_FOUND, rt.mesh.modelSize, mm.ModelSizeRequest(modelId="never-loaded"))


def test_predict_model_size_from_files(rt):
    path = rt.model_dir("sized")
    with open(os.path.join(path, "weights.bin"), "wb") as f:
        f.write(b"\0" * 40 * MiB)
    key = json.dumps({"model_type": {"name": "python"}})
    answer = rt.mesh.predictModelSize(
        mm.PredictModelSizeRequest(modelId="sized", modelPath=path, modelKey=key), timeout=0.5
    )  # model-mesh's deadline
    assert int(40 * MiB * 1.25) <= answer.sizeInBytes < 51 * MiB
    small = rt.mesh.predictModelSize(
        mm.PredictModelSizeRequest(modelId="tiny", modelPath=rt.model_dir("tiny"), modelKey=key), timeout=0.5
    )
    assert small.sizeInBytes >= 8 * MiB  # the format's floor, never 0
    assert rt.model_workers() == 0


def test_predict_model_size_before_the_storage_helper_pulled_the_files(rt):
    """Behind the storage helper, predictModelSize carries the path in storage: not here yet."""
    key = json.dumps({"model_type": {"name": "python"}, "storage_key": "default", "bucket": "models"})
    request = mm.PredictModelSizeRequest(modelId="remote", modelPath="iris/in-the-bucket", modelKey=key)
    answer = rt.mesh.predictModelSize(request, timeout=0.5)
    assert answer.sizeInBytes >= 8 * MiB  # the format's floor
    unnamed = mm.PredictModelSizeRequest(modelId="remote", modelPath="iris/in-the-bucket", modelKey="{}")
    expect_status(grpc.StatusCode.FAILED_PRECONDITION, rt.mesh.predictModelSize, unnamed)
    assert rt.model_workers() == 0


@pytest.mark.parametrize(
    "path", ["/etc/no-such-file", "../../../etc/no-such-file", "a\0b", "out/no-such-file"]
)
def test_predict_model_size_tells_nothing_of_what_lies_outside_the_roots(rt, path):
    link = os.path.join(rt.models, "out")
    if not os.path.lexists(link):
        os.symlink("/etc", link)  # a link inside the root that leads out of it
    key = json.dumps({"model_type": {"name": "python"}})
    request = mm.PredictModelSizeRequest(modelId="probe", modelPath=path, modelKey=key)
    assert status_of(rt.mesh.predictModelSize, request) is not grpc.StatusCode.OK


def test_predict_model_size_bad_path(rt):
    request = mm.PredictModelSizeRequest(modelId="x", modelPath="/etc", modelKey="")
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, rt.mesh.predictModelSize, request)


# -- memory ------------------------------------------------------------------------------


@pytest.mark.slow  # allocates 300 MiB and waits for memory to settle three times
def test_memory_back_after_unload_and_size_matches_growth(rt):
    warm_up = rt.model_dir("warm-up")
    rt.load("warm-up", warm_up)
    rt.unload("warm-up")
    before = rt.settled_uss()
    size = rt.load("big", rt.model_dir("big", allocating_model(300))).sizeInBytes
    loaded = rt.settled_uss()
    growth = loaded - before
    assert growth > 290 * MiB
    assert abs(size - growth) <= 0.10 * growth, f"reported {size}, measured growth {growth}"
    rt.unload("big")
    after = rt.settled_uss()
    assert abs(after - before) <= 2 * MiB, f"before {before}, after {after}"


@pytest.mark.slow  # allocates 200 MiB, waits for memory to settle twice, then 3 s more
@pytest.mark.parametrize("unload_after", [0.0, 0.5, 3.0], ids=["immediately", "after-0.5s", "after-3s"])
def test_cancelled_load_gives_memory_back(rt, unload_after):
    model_id = f"cancel-{unload_after}"
    path = rt.model_dir(model_id, allocating_model(200, sleep_s=60))
    open(os.path.join(path, "slow"), "w").close()
    rt.load("warm-up", rt.model_dir("warm-up"))
    rt.unload("warm-up")
    before = rt.settled_uss()
    future = rt.load_future(model_id, path)
    worker = wait_until(lambda: rt.worker_for(model_id), what="the load to start")
    wait_until(lambda: _uss_or_zero(worker) > 150 * MiB, what="the model to allocate")
    future.cancel()
    if unload_after:
        time.sleep(unload_after)
    rt.unload(model_id)
    assert not worker.is_running() or worker.status() == "zombie"
    assert rt.worker_for(model_id) is None
    expect_status(grpc.StatusCode.NOT_FOUND, rt.infer_fp32, model_id, [1.0])
    assert abs(rt.settled_uss() - before) <= 2 * MiB
    time.sleep(3)
    expect_status(grpc.StatusCode.NOT_FOUND, rt.infer_fp32, model_id, [1.0])  # no late completion revived it
    os.unlink(os.path.join(path, "slow"))
    assert rt.load(model_id, path).sizeInBytes > 190 * MiB
    rt.unload(model_id)


def _uss_or_zero(process) -> int:
    try:
        return process.memory_full_info().uss
    except Exception:
        return 0


def test_unload_during_load_cancels_it(rt):
    path = rt.model_dir("unload-mid-load", GATED_MODEL)
    future = rt.load_future("unload-mid-load", path)
    worker = wait_until(lambda: rt.worker_for("unload-mid-load"), what="the load to start")
    rt.unload("unload-mid-load")
    assert not worker.is_running() or worker.status() == "zombie"
    error = future.exception(timeout=10)
    assert error is not None and error.code() == grpc.StatusCode.CANCELLED
    open(os.path.join(path, "go"), "w").close()
    expect_status(grpc.StatusCode.NOT_FOUND, rt.infer_fp32, "unload-mid-load", [1.0])


def test_load_unload_load_in_quick_succession_ends_loaded(rt):
    path = rt.model_dir("flip")
    results = []

    def call(action):
        try:
            action()
            results.append("ok")
        except grpc.RpcError as error:
            results.append(error.code())

    threads = [
        threading.Thread(target=call, args=(lambda: rt.load("flip", path),)),
        threading.Thread(target=call, args=(lambda: rt.unload("flip"),)),
    ]
    for thread in threads:
        thread.start()
        time.sleep(0.002)
    for thread in threads:
        thread.join()
    rt.load("flip", path)
    assert rt.infer_fp32("flip", [1.0]).outputs
    assert rt.model_workers() == 1
    rt.unload("flip")


def test_no_warm_spares_still_loads():
    with Runtime(WORKERS_WARM="0") as runtime:
        assert runtime.workers() == []
        runtime.load("cold", runtime.model_dir("cold"))
        assert runtime.infer_fp32("cold", [1.0]).outputs
        runtime.unload("cold")


def test_workers_max_refuses_a_load_beyond_the_cap():
    with Runtime(WORKERS_WARM="1", WORKERS_MAX="1") as runtime:
        runtime.load("first", runtime.model_dir("first"))
        second = runtime.model_dir("second")
        error = expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, runtime.load, "second", second)
        assert "WORKERS_MAX" in error.details()
        runtime.unload("first")
        runtime.load("second", runtime.model_dir("second"))
        runtime.unload("second")


def test_loads_waiting_together_for_the_last_worker_the_cap_allows_are_refused_at_once_but_one():
    # Each found room when it asked; the refill forks the one worker left, then stops at the cap:
    # the other waited for a reap (LOADTIME_TIMEOUT, said as a load that ran too long).
    with Runtime(WORKERS_WARM="1", WORKERS_MAX="2", LOADTIME_TIMEOUT="30000") as runtime:
        folder = runtime.model_dir("echo")
        started = time.monotonic()
        loads = [runtime.load_future(model_id, folder) for model_id in ("a", "b", "c")]
        errors = [load.exception(timeout=60) for load in loads]
        assert time.monotonic() - started < 10, errors
        assert sorted(error.code().name if error else "OK" for error in errors) == [
            "OK",
            "OK",
            "RESOURCE_EXHAUSTED",
        ]


@pytest.mark.parametrize("per_worker", ["1", "4"], ids=["own-workers", "packs"])
def test_under_workers_max_the_sizes_fill_the_capacity_as_the_workers_run_out(per_worker):
    # model-mesh knows no limit but memory: had the sizes stayed small, it would see a pod nearly
    # empty whose every load fails, and would never unload a model there to make room.
    settings = {"WORKERS_WARM": "1", "WORKERS_MAX": "3", "MODELS_PER_WORKER": per_worker}
    with Runtime(CONTAINER_MEM_REQ_BYTES=str(2 * 1024 * MiB), **settings) as runtime:
        status = runtime.status
        usable, full = _mesh_cache_units(status)
        places = 3 * int(per_worker)  # the spare takes the last load
        sizes = [runtime.load(f"m{i}", runtime.model_dir(f"m{i}")).sizeInBytes for i in range(places)]
        units = sum(-(-size // 8192) for size in sizes)
        assert usable - full < units <= usable, (sizes, usable, full)  # all fit, and model-mesh sees it full
        model_size = runtime.mesh.modelSize(mm.ModelSizeRequest(modelId="m0"), timeout=30).sizeInBytes
        assert model_size == sizes[0]
        request = mm.PredictModelSizeRequest(modelId="next", modelPath=runtime.model_dir("next"))
        assert runtime.mesh.predictModelSize(request, timeout=30).sizeInBytes >= min(sizes)
        expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, runtime.load, "over", runtime.model_dir("over"))


def _mesh_cache_units(status) -> tuple[int, int]:
    """(units model-mesh fills with models, free units under which it takes the pod for full), as
    its code works them out from runtimeStatus (the contract doc, section 1.2)."""
    capacity, threads = status.capacityInBytes // 8192, status.maxLoadingConcurrency
    default = -(-status.defaultModelSizeInBytes // 8192)
    kept = min(max(threads * default // (2 if threads <= 2 else 4), capacity // 100), capacity // 10)
    full = max(default * (1 if threads <= 1 else 2), min(default * threads, capacity // 20))
    return capacity - kept, full
