"""The KServe V2 data plane through a real runtime: clients, datatypes, replicas, queues, deadlines."""

import concurrent.futures
import importlib.util
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest
from harness import MiB, Runtime, expect_status, mesh_headers, wait_until
from test_v2 import CONTENTS_FIELD  # the typed contents field of each datatype

from protos import grpc_predict_v2_pb2 as v2
from runtime.replicas import PIPELINE_DEPTH

ECHO = """
    import numpy as np

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            return dict(inputs)

        def metadata(self):
            return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}],
                    "outputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 4]}]}
"""

# Reports which process served it; waits while the file "hold" exists in its
# folder; appends one line to "ran" per call it runs.
PID_MODEL = """
    import os, time
    import numpy as np

    class Model:
        def __init__(self, path):
            self.path = path

        def predict(self, inputs):
            with open(os.path.join(self.path, "ran"), "a") as log:
                log.write("call\\n")
            while os.path.exists(os.path.join(self.path, "hold")):
                time.sleep(0.01)
            return {"pid": np.array([os.getpid()], dtype=np.int64)}

        def handle(self, method, request):
            return method.encode() + b"|" + request
"""


@pytest.fixture(scope="module")
def echo(runtime):
    runtime.load("echo", runtime.model_dir("echo", ECHO))
    yield runtime
    runtime.unload("echo")


# -- the official client ---------------------------------------------------------------


def test_tritonclient_health_metadata_and_infer(echo):
    if importlib.util.find_spec("tritonclient") is None:  # not imported here: see tritonclient_check.py
        pytest.skip("tritonclient[grpc] is not installed (it is in the test extra)")
    done = subprocess.run(
        [
            sys.executable,
            os.path.join(os.path.dirname(__file__), "tritonclient_check.py"),
            str(echo.port),
            "echo",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tritonclient checks passed" in done.stdout


# -- every datatype, raw and typed ----------------------------------------------------------

SAMPLES = {
    "BOOL": np.array([[True, False, True]]),
    "UINT8": np.array([[0, 7, 255]], dtype=np.uint8),
    "UINT16": np.array([[0, 7, 65535]], dtype=np.uint16),
    "UINT32": np.array([[0, 7, 2**32 - 1]], dtype=np.uint32),
    "UINT64": np.array([[0, 7, 2**64 - 1]], dtype=np.uint64),
    "INT8": np.array([[-128, 0, 127]], dtype=np.int8),
    "INT16": np.array([[-32768, 0, 32767]], dtype=np.int16),
    "INT32": np.array([[-(2**31), 0, 2**31 - 1]], dtype=np.int32),
    "INT64": np.array([[-(2**63), 0, 2**63 - 1]], dtype=np.int64),
    "FP16": np.array([[0.5, -2.0, 65504]], dtype=np.float16),
    "FP32": np.array([[0.25, -1e30, 3.5]], dtype=np.float32),
    "FP64": np.array([[0.1, -1e300, 2.5]], dtype=np.float64),
    "BYTES": np.array([[b"a", b"\x00\xff", "é".encode()]], dtype=np.object_),
}
NUMPY_TYPE = {name: array.dtype for name, array in SAMPLES.items()}


def _raw(datatype, array):
    if datatype == "BYTES":
        return b"".join(len(e).to_bytes(4, "little") + e for e in array.ravel())
    return array.astype(array.dtype.newbyteorder("<")).tobytes()


def _from_raw(datatype, data, shape):
    if datatype == "BYTES":
        elements, pos = [], 0
        while pos < len(data):
            length = int.from_bytes(data[pos : pos + 4], "little")
            elements.append(data[pos + 4 : pos + 4 + length])
            pos += 4 + length
        return np.array(elements, dtype=np.object_).reshape(shape)
    return np.frombuffer(data, dtype=NUMPY_TYPE[datatype]).reshape(shape)


@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_every_datatype_raw_round_trip(echo, datatype):
    array = SAMPLES[datatype]
    request = v2.ModelInferRequest(model_name="echo")
    request.inputs.add(name="t", datatype=datatype, shape=array.shape)
    request.raw_input_contents.append(_raw(datatype, array))
    answer = echo.infer.ModelInfer(request, metadata=mesh_headers("echo"))
    (out,) = answer.outputs
    assert out.datatype == datatype and list(out.shape) == list(array.shape)
    assert not out.HasField("contents")
    np.testing.assert_array_equal(_from_raw(datatype, answer.raw_output_contents[0], array.shape), array)


@pytest.mark.parametrize("datatype", [d for d in SAMPLES if d in CONTENTS_FIELD])
def test_every_datatype_typed_round_trip(echo, datatype):
    array = SAMPLES[datatype]
    request = v2.ModelInferRequest(model_name="echo")
    tensor = request.inputs.add(name="t", datatype=datatype, shape=array.shape)
    getattr(tensor.contents, CONTENTS_FIELD[datatype]).extend(array.ravel().tolist())
    answer = echo.infer.ModelInfer(request)
    (out,) = answer.outputs
    assert out.datatype == datatype and not answer.raw_output_contents
    values = np.array(list(getattr(out.contents, CONTENTS_FIELD[datatype])), dtype=array.dtype)
    np.testing.assert_array_equal(values.reshape(array.shape), array)


def test_bf16_raw_input_reaches_the_model_as_float32(echo):
    request = v2.ModelInferRequest(model_name="echo")
    request.inputs.add(name="b", datatype="BF16", shape=[2])
    request.raw_input_contents.append(np.array([0x3FC0, 0xC000], dtype="<u2").tobytes())  # 1.5, -2.0
    answer = echo.infer.ModelInfer(request)
    assert answer.outputs[0].datatype == "FP32"
    assert list(np.frombuffer(answer.raw_output_contents[0], dtype=np.float32)) == [1.5, -2.0]


def test_requested_outputs_select_and_order(echo):
    request = v2.ModelInferRequest(model_name="echo")
    for name in ("a", "b", "c"):
        request.inputs.add(name=name, datatype="INT32", shape=[1]).contents.int_contents.append(1)
    request.outputs.add(name="c")
    request.outputs.add(name="a")
    assert [o.name for o in echo.infer.ModelInfer(request).outputs] == ["c", "a"]
    request.outputs.add(name="zzz")
    error = expect_status(grpc.StatusCode.INVALID_ARGUMENT, echo.infer.ModelInfer, request)
    assert "zzz" in error.details()


@pytest.mark.parametrize(
    "mutate, words",
    [
        (lambda r: r.inputs[0].shape.extend([10**12]), "elements"),
        (lambda r: setattr(r.inputs[0], "datatype", "FLOAT"), "unknown datatype"),
        (lambda r: r.raw_input_contents.__setitem__(0, b"\0" * 3), "needs 16 bytes"),
        (lambda r: r.raw_input_contents.append(b""), "raw_input_contents has 2 entries"),
    ],
    ids=["huge-shape", "bad-datatype", "short-raw", "extra-raw"],
)
def test_bad_tensors_are_invalid_argument(echo, mutate, words):
    request = v2.ModelInferRequest(model_name="echo")
    request.inputs.add(name="x", datatype="FP32", shape=[4])
    request.raw_input_contents.append(np.zeros(4, dtype=np.float32).tobytes())
    mutate(request)
    error = expect_status(grpc.StatusCode.INVALID_ARGUMENT, echo.infer.ModelInfer, request)
    assert words in error.details() and "not found" not in error.details().lower()


def test_16_mib_request_and_response(echo):
    big = np.random.default_rng(1).random(4 * MiB, dtype=np.float32)
    request = v2.ModelInferRequest(model_name="echo")
    request.inputs.add(name="x", datatype="FP32", shape=[big.size])
    request.raw_input_contents.append(big.tobytes())
    answer = echo.infer.ModelInfer(request, timeout=60)
    assert answer.raw_output_contents[0] == request.raw_input_contents[0]


def test_custom_method_without_allow_any_method_is_unimplemented(echo):
    call = echo.channel.unary_unary("/acme.Scorer/Score")
    expect_status(grpc.StatusCode.UNIMPLEMENTED, call, b"payload", metadata=mesh_headers("echo"))


# -- replicas, threads, queue, custom methods (their own runtime) --------------------------------


@pytest.fixture(scope="module")
def replicated():
    with Runtime(
        MODEL_REPLICAS="2",
        WORKER_THREADS="2",
        LIMIT_MODEL_CONCURRENCY="true",
        ALLOW_ANY_METHOD="true",
        WORKERS_WARM="2",
    ) as runtime:
        yield runtime


def test_status_reports_concurrency_and_any_method(replicated):
    assert replicated.status.limitModelConcurrency and replicated.status.allowAnyMethod
    answer = replicated.load("pids", replicated.model_dir("pids", PID_MODEL))
    assert answer.maxConcurrency == 4
    replicated.unload("pids")


def test_64_concurrent_requests_spread_over_both_replicas(replicated):
    replicated.load("spread", replicated.model_dir("spread", PID_MODEL))
    workers = {p.pid for p in replicated.workers() if "model=spread" in " ".join(p.cmdline())}
    assert len(workers) == 2

    def call(_):
        answer = replicated.infer.ModelInfer(v2.ModelInferRequest(model_name="spread"), timeout=30)
        return (
            int(np.frombuffer(answer.raw_output_contents[0], dtype=np.int64)[0])
            if answer.raw_output_contents
            else answer.outputs[0].contents.int64_contents[0]
        )

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        served_by = list(pool.map(call, range(64)))
    assert len(served_by) == 64
    assert set(served_by) == workers
    replicated.unload("spread")


def test_allow_any_method_leaves_health_and_reflection_alone(replicated):
    """The inference service is asked first for every method; it must not take these."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    health = health_pb2_grpc.HealthStub(replicated.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    answers = reflection_pb2_grpc.ServerReflectionStub(replicated.channel).ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    services = {s.name for answer in answers for s in answer.list_services_response.service}
    assert {"mmesh.ModelRuntime", "inference.GRPCInferenceService"} <= services


def test_custom_method_reaches_handle(replicated):
    replicated.load("custom", replicated.model_dir("custom", PID_MODEL))
    call = replicated.channel.unary_unary("/acme.Scorer/Score")
    assert call(b"payload", metadata=mesh_headers("custom")) == b"acme.Scorer/Score|payload"
    replicated.load("no-handle", replicated.model_dir("no-handle", ECHO))
    expect_status(grpc.StatusCode.UNIMPLEMENTED, call, b"payload", metadata=mesh_headers("no-handle"))
    replicated.unload("custom")
    replicated.unload("no-handle")


def test_model_runtime_methods_are_never_forwarded(replicated):
    call = replicated.channel.unary_unary("/mmesh.ModelRuntime/noSuchCall")
    expect_status(grpc.StatusCode.UNIMPLEMENTED, call, b"", metadata=mesh_headers("x"))


@pytest.fixture(scope="module")
def single():
    with Runtime(MODEL_QUEUE_MAX="2", WORKERS_WARM="1") as runtime:
        yield runtime


def _hold(runtime, model_id):
    path = runtime.model_dir(model_id, PID_MODEL)
    runtime.load(model_id, path)
    open(os.path.join(path, "hold"), "w").close()
    return path


def _runs(path):
    try:
        with open(os.path.join(path, "ran")) as log:
            return len(log.readlines())
    except FileNotFoundError:
        return 0


def test_queue_overflow_is_resource_exhausted(single):
    path = _hold(single, "queued")
    pool = concurrent.futures.ThreadPoolExecutor(8)
    request = v2.ModelInferRequest(model_name="queued")
    running = pool.submit(single.infer.ModelInfer, request, timeout=30)
    wait_until(lambda: _runs(path) == 1, what="the first call to run")
    # PIPELINE_DEPTH calls wait inside the worker, MODEL_QUEUE_MAX=2 in the front.
    waiting = [pool.submit(single.infer.ModelInfer, request, timeout=30) for _ in range(PIPELINE_DEPTH + 2)]
    time.sleep(0.5)
    error = expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, single.infer.ModelInfer, request, timeout=30)
    assert "MODEL_QUEUE_MAX" in error.details()
    os.unlink(os.path.join(path, "hold"))
    for future in [running, *waiting]:
        assert future.result(timeout=30).outputs
    pool.shutdown()
    single.unload("queued")


def test_expired_request_is_dropped_not_run(single):
    path = _hold(single, "deadlines")
    pool = concurrent.futures.ThreadPoolExecutor(1)
    request = v2.ModelInferRequest(model_name="deadlines")
    running = pool.submit(single.infer.ModelInfer, request, timeout=30)
    wait_until(lambda: _runs(path) == 1, what="the first call to run")
    expect_status(grpc.StatusCode.DEADLINE_EXCEEDED, single.infer.ModelInfer, request, timeout=0.3)
    os.unlink(os.path.join(path, "hold"))
    assert running.result(timeout=30).outputs
    assert single.infer.ModelInfer(request, timeout=30).outputs  # the worker is free again
    assert _runs(path) == 2, "the expired request ran anyway"
    pool.shutdown()
    single.unload("deadlines")
