"""The contract doc's mesh simulator checklist, driven as model-mesh drives it, with packs (the default).

Only what no other module checks: there the runtime gives every model a worker of its own.
"""

import json
import os
import threading
import time

import grpc
import pytest
from harness import ECHO_MODEL, MiB, Runtime, expect_status, status_of, wait_until, write_model

from protos import model_runtime_pb2 as mm

LOAD_TIMEOUT_S = 2.0

# Sleeps in its constructor while the file "slow" is in its folder.
SLOW_MODEL = """
    import os, time

    class Model:
        def __init__(self, path):
            while os.path.exists(os.path.join(path, "slow")):
                time.sleep(0.01)

        def predict(self, inputs):
            return inputs
"""

# Exits its worker when called with an input named "crash".
CRASHING_MODEL = """
    import os

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            if "crash" in inputs:
                os._exit(7)
            return inputs
"""


@pytest.fixture(scope="module")
def mesh():
    settings = {"MODELS_PER_WORKER": "32", "LOADTIME_TIMEOUT": str(int(LOAD_TIMEOUT_S * 1000))}
    with Runtime(CONTAINER_MEM_REQ_BYTES=str(2048 * MiB), **settings) as runtime:
        yield runtime


def pulled(runtime, model_id: str, source: str = ECHO_MODEL) -> str:
    """The model's folder where the puller writes it: /models/<modelId>/<basename>."""
    return write_model(os.path.join(runtime.models, model_id, "model"), source)


def slow(path: str) -> str:
    open(os.path.join(path, "slow"), "w").close()
    return path


def load_request(model_id: str, path: str, **key) -> mm.LoadModelRequest:
    """As model-mesh sends it through the puller: a label in modelType, the format in modelKey."""
    key = {"model_type": {"name": "python", "version": "1"}, "disk_size_bytes": 123, **key}
    key_json = json.dumps(key)
    return mm.LoadModelRequest(
        modelId=model_id, modelType="rt:mesh-runtime", modelPath=path, modelKey=key_json
    )


def load_cancelled_after(runtime, model_id: str, path: str, seconds: float) -> None:
    """loadModel with no deadline, cancelled after `seconds`, as model-mesh times out or evicts."""
    future = runtime.mesh.loadModel.future(load_request(model_id, path))
    with pytest.raises(grpc.FutureTimeoutError):
        future.result(timeout=seconds)
    future.cancel()


def test_restart_purge_with_packs_and_a_load_in_flight(mesh):
    """A4: READY comes only once every model, packed or loading, is gone; capacity as at start."""
    capacity = mesh.status.capacityInBytes
    ids = [f"purged-{i}__isvc-000000000{i}" for i in range(3)]
    for model_id in ids:
        mesh.load(model_id, pulled(mesh, model_id))
    loading = mesh.mesh.loadModel.future(load_request("loading", slow(pulled(mesh, "loading", SLOW_MODEL))))
    wait_until(lambda: "loading loading" in mesh.log(), what="the slow load to start")
    status = mesh.mesh.runtimeStatus(mm.RuntimeStatusRequest(), timeout=60)
    assert status.status == mm.RuntimeStatusResponse.READY
    assert loading.exception(timeout=10).code() == grpc.StatusCode.CANCELLED
    assert not any(f"the load of {model_id} was abandoned" in mesh.log() for model_id in ids), mesh.log()
    for model_id in [*ids, "loading"]:
        expect_status(grpc.StatusCode.NOT_FOUND, mesh.infer_fp32, model_id, [1.0])
    assert mesh.packs() == [] and mesh.model_workers() == 0
    assert abs(status.capacityInBytes - capacity) < 8 * MiB, (status.capacityInBytes, capacity)
    mesh.unload(ids[0])  # what the puller sends for each folder it finds: OK
    mesh.load(ids[0], pulled(mesh, ids[0]))
    assert mesh.infer_fp32(ids[0], [1.0]).outputs
    mesh.unload(ids[0])


def test_load_the_puller_rewrote_is_read_from_model_key(mesh):
    """B7: modelType is a label to ignore; modelKey carries the format and keys nobody knows."""
    path = pulled(mesh, "keyed__isvc-0123456789")
    request = load_request("keyed__isvc-0123456789", path, schema_path=path + "/_schema.json", extra={"a": 1})
    request.modelType = "mt:sklearn:1"
    assert mesh.mesh.loadModel(request, timeout=30).sizeInBytes > 0
    assert mesh.infer_fp32("keyed__isvc-0123456789", [1.0]).outputs
    mesh.unload("keyed__isvc-0123456789")
    by_name = mm.LoadModelRequest(modelId="named", modelPath=path, modelKey='{"model_type": "python"}')
    assert mesh.mesh.loadModel(by_name, timeout=30).sizeInBytes > 0
    mesh.unload("named")


def test_predict_model_size_answers_within_mesh_deadline_and_loads_are_idempotent_in_a_pack(mesh):
    """B6 and B12: a quick conservative prediction; a second load answers the same size and adds nothing."""
    path = pulled(mesh, "twice")
    request = mm.PredictModelSizeRequest(modelId="twice", modelType="rt:x", modelPath=path, modelKey="{}")
    predicted = mesh.mesh.predictModelSize(request, timeout=0.5).sizeInBytes
    size = mesh.load("twice", path).sizeInBytes
    assert predicted >= size > 0
    packs = {p.pid for p in mesh.packs()}
    assert mesh.load("twice", path).sizeInBytes == size
    assert {p.pid for p in mesh.packs()} == packs
    assert [" ".join(p.cmdline()).count("models=1") for p in mesh.packs()] == [1]
    mesh.unload("twice")


@pytest.mark.parametrize("delay", [0.0, 0.5], ids=["at-once", "after-0.5s"])
def test_packed_load_cancelled_then_unloaded_leaves_nothing(mesh, delay):
    """B11: eviction of a packed model mid-load; its neighbours serve on; no late completion."""
    mesh.load("neighbour", pulled(mesh, "neighbour"))
    path = slow(pulled(mesh, f"evicted-{delay}", SLOW_MODEL))
    load_cancelled_after(mesh, f"evicted-{delay}", path, 0.3)
    time.sleep(delay)
    mesh.unload(f"evicted-{delay}")
    expect_status(grpc.StatusCode.NOT_FOUND, mesh.infer_fp32, f"evicted-{delay}", [1.0])
    os.unlink(os.path.join(path, "slow"))  # a constructor still running would finish now
    time.sleep(0.3)
    expect_status(grpc.StatusCode.NOT_FOUND, mesh.infer_fp32, f"evicted-{delay}", [1.0])
    assert mesh.infer_fp32("neighbour", [2.0]).outputs
    mesh.load(f"evicted-{delay}", path)
    mesh.unload(f"evicted-{delay}")
    mesh.unload("neighbour")


def test_load_past_the_timeout_then_unload_a_second_later_then_load_again(mesh):
    """B9/B10: the runtime's own timeout fails the load; mesh's unload 1 s later is OK; a reload loads."""
    path = slow(pulled(mesh, "late", SLOW_MODEL))
    started = time.monotonic()
    expect_status(grpc.StatusCode.DEADLINE_EXCEEDED, mesh.mesh.loadModel, load_request("late", path))
    assert time.monotonic() - started < LOAD_TIMEOUT_S + 1
    time.sleep(1.0)
    mesh.unload("late")
    expect_status(grpc.StatusCode.NOT_FOUND, mesh.infer_fp32, "late", [1.0])
    os.unlink(os.path.join(path, "slow"))
    assert mesh.mesh.loadModel(load_request("late", path), timeout=30).sizeInBytes > 0
    mesh.unload("late")


def test_unload_of_ids_never_loaded_is_ok_at_once(mesh):
    """C15: whatever the id, an unknown one unloads at once, OK (NOT_FOUND would do too)."""
    for model_id in ["never__isvc-0000000000", "modèle-ü", "a\nb", "x" * 2000]:
        started = time.monotonic()
        assert status_of(mesh.mesh.unloadModel, mm.UnloadModelRequest(modelId=model_id), timeout=5) in (
            grpc.StatusCode.OK,
            grpc.StatusCode.NOT_FOUND,
        )
        assert time.monotonic() - started < 1


def test_a_dropped_model_answers_not_found_and_loads_again(mesh):
    """D23: a model that keeps crashing is dropped; mesh reloads it through loadModel and retries."""
    path = pulled(mesh, "crashy", CRASHING_MODEL)
    mesh.load("crashy", path)
    codes = []
    while len(codes) < 10 and grpc.StatusCode.NOT_FOUND not in codes:
        codes.append(status_of(mesh.infer_fp32, "crashy", [1.0], name="crash"))
    assert codes[-1] == grpc.StatusCode.NOT_FOUND and set(codes[:-1]) == {grpc.StatusCode.UNAVAILABLE}, codes
    mesh.load("crashy", path)
    assert mesh.infer_fp32("crashy", [1.0]).outputs
    mesh.unload("crashy")


def test_load_unload_load_of_one_id_ends_as_the_last_asked(mesh):
    """C17: the same id loaded, unloaded and loaded back to back ends loaded, in one place."""
    path = pulled(mesh, "flipped")
    for _ in range(3):
        mesh.load("flipped", path)
        unloading = threading.Thread(target=mesh.unload, args=("flipped",))
        unloading.start()
        mesh.load("flipped", path)
        unloading.join()
        code = status_of(mesh.infer_fp32, "flipped", [1.0])
        if code is grpc.StatusCode.NOT_FOUND:  # the unload came last after all: load as mesh would
            mesh.load("flipped", path)
        assert mesh.infer_fp32("flipped", [1.0]).outputs
    mesh.unload("flipped")
    expect_status(grpc.StatusCode.NOT_FOUND, mesh.infer_fp32, "flipped", [1.0])
