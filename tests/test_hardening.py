"""Hostile clients: one request must not stall the front, big calls must not grow it without bound,
and an id that cannot be logged or titled is refused before any worker is touched."""

import asyncio
import concurrent.futures
import os
import threading
import time

import grpc
import numpy as np
import psutil
import pytest
from harness import (
    MiB,
    Runtime,
    expect_status,
    free_port,
    mesh_headers,
    metric_sample,
    scrape_metrics,
    status_of,
    wait_until,
)

from protos import grpc_predict_v2_pb2 as v2
from protos import model_runtime_pb2 as mm
from protos import wire
from runtime import dataplane, status
from runtime.budget import READ_LINE_MAX, ByteBudget
from runtime.server import CONTROL_READS_AT_ONCE, STREAM_WINDOW_BYTES

INFER = "/inference.GRPCInferenceService/ModelInfer"

SLOW_MODEL = """
    import time
    import numpy as np

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            x = inputs["x"]
            if x.size > 1000:
                time.sleep(0.2)
            return {"n": np.array([x.size], dtype=np.int64)}
"""

BIG_OUTPUT_MODEL = """
    import numpy as np

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            return {"big": np.zeros(int(inputs["x"][0]), dtype=np.uint8)}
"""


def _call(channel, body: bytes, metadata=None, timeout: float = 60):
    try:
        channel.unary_unary(INFER)(body, metadata=metadata, timeout=timeout)
        return None
    except grpc.RpcError as error:
        return error


def _raw_request(model_id: str, data: bytes) -> bytes:
    request = v2.ModelInferRequest(model_name=model_id)
    request.inputs.add(name="x", datatype="UINT8", shape=[len(data)])
    request.raw_input_contents.append(data)
    return request.SerializeToString()


# -- the model id search is bounded ----------------------------------------------------------


def test_model_id_found_within_the_bound_even_when_appended_last():
    body = b"\x10\x00" * (dataplane.ID_SEARCH_MAX_FIELDS - 1) + b"\x0a\x01m"
    assert dataplane.model_id_in_request(body) == "m"


def test_model_id_past_the_bound_is_invalid_argument_without_walking_on():
    body = b"\x10\x00" * dataplane.ID_SEARCH_MAX_FIELDS + b"\x0a\x01m"
    with pytest.raises(status.RpcError) as raised:
        dataplane.model_id_in_request(body)
    assert raised.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "mm-model-id" in raised.value.message


def test_every_walk_of_the_wire_format_is_bounded():
    body = b"\x10\x00" * (wire.MAX_FIELDS + 1)
    with pytest.raises(wire.TooManyFields):
        wire.split_bytes_field(body, 7)
    assert wire.split_bytes_field(b"\x10\x00" * wire.MAX_FIELDS, 7)[1] == []


@pytest.fixture(scope="module")
def guarded():
    """A runtime that judges workers after 2 s of silence, so a stall of the front would show."""
    with Runtime(WORKER_HEARTBEAT_TIMEOUT_MS="2000", LOADTIME_TIMEOUT="20000") as runtime:
        runtime.load("m", runtime.model_dir("m"))
        yield runtime


def _poll_server_live(runtime, stop: threading.Event, latencies: list, failures: list) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{runtime.port}")
    live = channel.unary_unary("/inference.GRPCInferenceService/ServerLive")
    request = v2.ServerLiveRequest().SerializeToString()
    try:
        while not stop.is_set():
            started = time.monotonic()
            try:
                live(request, timeout=5)
                latencies.append(time.monotonic() - started)
            except grpc.RpcError as error:
                failures.append(error.code())
            stop.wait(0.1)
    finally:
        channel.close()


HOSTILE_BODIES = {
    # Field 2 over and over; field 1 never comes. Over the default GRPC_MAX_MESSAGE_BYTES, grpc
    # refuses it before copying it onto the event loop; under it, the id search gives up early.
    "60 MiB": (b"\x10\x00" * (30 * MiB), grpc.StatusCode.RESOURCE_EXHAUSTED),
    "16 MiB": (b"\x10\x00" * (8 * MiB), grpc.StatusCode.INVALID_ARGUMENT),
}


@pytest.mark.slow  # waits out the silence limit after sending each size
@pytest.mark.parametrize("size", HOSTILE_BODIES)
def test_hostile_body_without_headers_does_not_stall_the_front(guarded, size):
    body, expected = HOSTILE_BODIES[size]
    worker = guarded.worker_for("m")
    stop, latencies, failures = threading.Event(), [], []
    poller = threading.Thread(target=_poll_server_live, args=(guarded, stop, latencies, failures))
    poller.start()
    try:
        time.sleep(0.3)
        for _ in range(3):
            expect_status(expected, guarded.channel.unary_unary(INFER), body, timeout=60)
        time.sleep(2.5)  # past the silence limit after the last one
    finally:
        stop.set()
        poller.join()
    assert not failures, failures
    assert len(latencies) >= 5
    assert max(latencies) < 0.1, f"ServerLive took up to {max(latencies) * 1000:.0f} ms"
    assert guarded.worker_for("m").pid == worker.pid, "the model's worker was replaced"
    log = guarded.log()
    assert "healing" not in log and "killing" not in log, log
    assert guarded.infer_fp32("m", [1.0]).outputs


def test_hostile_body_under_the_limit_names_the_header_to_send(guarded):
    body, expected = HOSTILE_BODIES["16 MiB"]
    error = expect_status(expected, guarded.channel.unary_unary(INFER), body, timeout=60)
    assert "mm-model-id" in error.details()


@pytest.mark.slow  # holds the front suspended past twice the silence limit
def test_a_stalled_front_judges_no_worker_on_its_own_silence(guarded):
    worker = guarded.worker_for("m")
    front = psutil.Process(guarded.pid)
    front.suspend()  # its event loop stops, as under a request that holds it
    try:
        time.sleep(4)  # twice WORKER_HEARTBEAT_TIMEOUT_MS
    finally:
        front.resume()
    wait_until(lambda: "stalled for" in guarded.log(), what="the front to notice its own stall")
    time.sleep(2.5)
    assert guarded.worker_for("m").pid == worker.pid
    assert "killing" not in guarded.log()
    assert guarded.infer_fp32("m", [2.0]).outputs


# -- byte budgets ----------------------------------------------------------------------


def test_byte_budget_counts_per_model_and_in_all():
    budget = ByteBudget(per_model=100, total=150, largest_request=50)
    budget.reserve("a", 60)
    budget.reserve("a", 40)
    with pytest.raises(status.RpcError) as raised:
        budget.reserve("a", 1)
    assert raised.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "MODEL_BYTES_MAX=100" in raised.value.message
    budget.reserve("b", 50)
    with pytest.raises(status.RpcError) as raised:
        budget.reserve("c", 1)
    assert "FRONT_BYTES_MAX=150" in raised.value.message
    budget.release("a", 60)
    budget.reserve("c", 10)
    assert (budget.held_by("a"), budget.held_by("c"), budget.held) == (40, 10, 100)
    for model_id, size in (("a", 40), ("b", 50), ("c", 10)):
        budget.release(model_id, size)
    assert budget.held == 0 and budget.held_by("a") == 0


def test_reads_wait_in_line_for_room_for_the_largest_request():
    async def scenario():
        budget = ByteBudget(per_model=100, total=100, largest_request=40)
        first = await budget.start_reading()
        second = await budget.start_reading()  # 80 of 100 reserved: a third read must wait
        third = asyncio.ensure_future(budget.start_reading())
        given_up = asyncio.ensure_future(budget.start_reading())
        await asyncio.sleep(0)
        assert not third.done()
        given_up.cancel()
        budget.done_reading(first)
        await asyncio.sleep(0)
        assert third.done() and budget.reading == 80
        budget.reserve("m", 30)  # held bytes count too: 30 + 80 leaves no room for another 40
        fourth = asyncio.ensure_future(budget.start_reading())
        budget.done_reading(second)
        await asyncio.sleep(0)
        assert not fourth.done()
        budget.release("m", 30)
        await asyncio.sleep(0)
        assert fourth.done() and budget.reading == 80 and budget.held == 0

    asyncio.run(scenario())


@pytest.mark.parametrize("name", ["FRONT_BYTES_MAX", "the control methods' read budget"])
def test_reads_beyond_the_line_limit_are_refused_at_once(name):
    async def scenario():
        budget = ByteBudget(per_model=100, total=100, largest_request=100, name=name)
        await budget.start_reading()
        waiting = [asyncio.ensure_future(budget.start_reading()) for _ in range(READ_LINE_MAX)]
        await asyncio.sleep(0)
        with pytest.raises(status.RpcError) as raised:
            await budget.start_reading()
        assert raised.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{READ_LINE_MAX} calls already wait for room in {name}=100" in raised.value.message
        for turn in waiting:
            turn.cancel()

    asyncio.run(scenario())


def test_a_read_given_up_on_as_another_ends_is_cancelled_and_leaves_nothing_reserved():
    async def scenario():
        budget = ByteBudget(per_model=100, total=100, largest_request=100)
        first = await budget.start_reading()
        waiting = asyncio.ensure_future(budget.start_reading())
        await asyncio.sleep(0)  # in line
        waiting.cancel()  # its deadline, in the same turn of the loop as...
        budget.done_reading(first)  # ...the read before it ending
        with pytest.raises(asyncio.CancelledError):
            await waiting
        return budget.reading

    assert asyncio.run(scenario()) == 0


BUDGET_MIB = {"GRPC_MAX_MESSAGE_BYTES": 32, "MODEL_BYTES_MAX": 96, "FRONT_BYTES_MAX": 128}
# What the front may hold beyond its idle size while 60 calls of 30 MiB arrive at once: the calls it
# holds and reads (FRONT_BYTES_MAX), grpc's copy of each as it is read and ZeroMQ's as it is sent, and
# the HTTP/2 window of each stream still waiting to be read.
FRONT_RSS_BOUND_MIB = 3 * BUDGET_MIB["FRONT_BYTES_MAX"] + 60 * STREAM_WINDOW_BYTES // MiB


def _peak_rss(pid: int, stop: threading.Event, peak: list) -> None:
    process = psutil.Process(pid)
    while not stop.is_set():
        peak[0] = max(peak[0], process.memory_info().rss)
        time.sleep(0.005)


@pytest.mark.slow  # sends 1.8 GB
def test_sixty_big_calls_to_a_slow_model_keep_the_front_bounded_and_the_small_ones_served():
    env = {name: str(mib * MiB) for name, mib in BUDGET_MIB.items()}
    with Runtime(**env) as runtime:
        runtime.load("slow", runtime.model_dir("slow", SLOW_MODEL))
        idle = psutil.Process(runtime.pid).memory_info().rss
        big = _raw_request("slow", b"\x01" * (30 * MiB))
        small = _raw_request("slow", b"\x01" * 10)
        stop, peak = threading.Event(), [idle]
        sampler = threading.Thread(target=_peak_rss, args=(runtime.pid, stop, peak))
        sampler.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(64) as pool:
                infer = runtime.channel.unary_unary(INFER)
                bigs = [
                    pool.submit(status_of, infer, big, metadata=mesh_headers("slow"), timeout=60)
                    for _ in range(60)
                ]
                smalls = [pool.submit(_call, runtime.channel, small, mesh_headers("slow")) for _ in range(4)]
                big_codes = [f.result() for f in bigs]
                small_errors = [f.result() for f in smalls]
        finally:
            stop.set()
            sampler.join()
        assert small_errors == [None] * 4, small_errors
        assert set(big_codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}, big_codes
        assert big_codes.count(grpc.StatusCode.OK) >= 1
        # How many the slow model serves meanwhile depends on the machine; the budget refuses the rest.
        assert big_codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 1
        grown_mib = (peak[0] - idle) / MiB
        assert grown_mib < FRONT_RSS_BOUND_MIB, f"the front grew by {grown_mib:.0f} MiB"
        refused = _call(runtime.channel, small, mesh_headers("slow"))
        assert refused is None, "the budget was not given back"


# -- model ids and responses ----------------------------------------------------------


@pytest.mark.parametrize(
    "model_id", ["a\0b", "a\nb", "forged\n2026-01-01 INFO loaded x", "tab\tid", "x\u2028y"]
)
def test_model_id_with_a_control_character_is_refused_before_any_worker(rt, model_id):
    spares = {p.pid for p in rt.spares()}
    error = expect_status(grpc.StatusCode.INVALID_ARGUMENT, rt.load, model_id, rt.model_dir("ctl"))
    assert "control character" in error.details()
    assert {p.pid for p in rt.spares()} == spares, "a worker was spent on a refused id"
    assert model_id not in rt.log()
    expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        rt.mesh.predictModelSize,
        mm.PredictModelSizeRequest(modelId=model_id, modelPath=rt.model_dir("ctl")),
    )


def test_long_error_messages_keep_their_status_and_are_cut_short(guarded):
    raising = "class Model:\n    def __init__(self, path):\n        pass\n\n    def predict(self, inputs):\n"
    guarded.load("raiser", guarded.model_dir("raiser", raising + '        raise ValueError("x" * 200000)\n'))
    error = expect_status(grpc.StatusCode.INTERNAL, guarded.infer_fp32, "raiser", [1.0])
    assert error.details().startswith("ValueError: xxx") and len(error.details()) < 1200
    request = v2.ModelInferRequest(model_name="m")
    request.inputs.add(name="n" * 100_000, datatype="NOPE", shape=[1])
    error = expect_status(
        grpc.StatusCode.INVALID_ARGUMENT, guarded.infer.ModelInfer, request, metadata=mesh_headers("m")
    )
    assert "more characters" in error.details()
    # Percent-encoded, a CJK character is nine bytes: cut by characters, the trailer passed a
    # client's 8 KiB metadata limit and the status became RESOURCE_EXHAUSTED, now and then.
    guarded.load("cjk", guarded.model_dir("cjk", raising + '        raise ValueError("模" * 2000)\n'))
    for _ in range(20):
        error = expect_status(grpc.StatusCode.INTERNAL, guarded.infer_fp32, "cjk", [1.0])
        assert error.details().startswith("ValueError: 模模")


def test_the_largest_answer_fits_a_budget_of_twice_the_largest_request():
    budget = ByteBudget(per_model=160, total=160, largest_request=80)
    budget.hold_response("m", 80)  # alone, with room to read beside it
    assert budget.try_start_reading() is not None
    with pytest.raises(status.RpcError):
        budget.hold_response("n", 10)
    budget.release_response("m", 80)
    assert budget.held == budget.sending == 0


def test_responses_not_yet_read_leave_the_budget_half_free_for_reading():
    # A client that reads none of its answers keeps them held till its calls end, however long.
    budget = ByteBudget(per_model=100, total=100, largest_request=10)
    for model_id in ("a", "b", "c", "d", "e"):
        budget.hold_response(model_id, 10)
    with pytest.raises(status.RpcError) as refused:
        budget.hold_response("f", 10)
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "half" in refused.value.message
    budget.reserve("g", 40)  # requests may take the rest
    assert budget.try_start_reading() is not None
    budget.release_response("a", 10)
    budget.hold_response("f", 10)
    assert budget.sending == 50 and budget.held == 90


def test_responses_not_yet_read_always_leave_room_to_read_the_largest_request():
    # Half of a budget under twice the largest request would not hold a read beside a held answer:
    # one client not reading its answer would stop every call's read.
    budget = ByteBudget(per_model=150, total=150, largest_request=100)
    with pytest.raises(status.RpcError) as refused:
        budget.hold_response("a", 60)
    assert refused.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "for a read" in refused.value.message
    budget.hold_response("a", 50)
    assert budget.try_start_reading() is not None


def _percent_encoded_length(text: str) -> int:
    """As grpc sends a status's message: printable ASCII but "%" as is, every other byte as %XX."""
    return sum(1 if 0x20 <= byte <= 0x7E and byte != ord("%") else 3 for byte in text.encode())


def test_a_model_error_no_utf8_can_hold_fails_its_call_alone(guarded):
    # A lone surrogate, as os.listdir() makes of an undecodable name: packing the message raised,
    # and the worker (a pack and its other models with it) died of it, call after call.
    raising = "class Model:\n    def __init__(self, path):\n        pass\n\n    def predict(self, inputs):\n"
    source = raising + '        raise FileNotFoundError("no " + "caf" + chr(0xDCE9) + ".csv")\n'
    guarded.load("undecodable", guarded.model_dir("undecodable", source))
    worker = guarded.worker_for("undecodable")
    for _ in range(3):
        error = expect_status(grpc.StatusCode.INTERNAL, guarded.infer_fp32, "undecodable", [1.0])
        assert "caf\\udce9.csv" in error.details()
    assert guarded.worker_for("undecodable").pid == worker.pid
    assert status.details("caf" + chr(0xDCE9)) == "caf\\udce9"


@pytest.mark.parametrize("text", ["x" * 5000, "模" * 2000, "😀" * 2000, "%" * 2000, "ab模" * 400])
def test_a_status_message_is_cut_by_its_encoded_length(text):
    sent = status.details(text)
    assert _percent_encoded_length(sent) <= status.DETAILS_MAX_BYTES
    assert sent.endswith(" more characters)") and text.startswith(sent.split("...")[0])
    assert status.details(text[:10]) == text[:10]


# Answers once a file named "go" is in its folder; says it has begun by writing "begun".
WAITING_MODEL = """
    import os, time

    class Model:
        def __init__(self, path):
            self.path = path

        def predict(self, inputs):
            open(os.path.join(self.path, "begun"), "w").close()
            while not os.path.exists(os.path.join(self.path, "go")):
                time.sleep(0.01)
            return dict(inputs)
"""


def test_model_mesh_and_health_calls_do_not_wait_behind_inference_calls_for_room_to_read():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    whole = 17825792  # GRPC_MAX_MESSAGE_BYTES: two held calls of over half of it leave no room to read
    with Runtime(FRONT_BYTES_MAX=str(2 * whole), MODEL_BYTES_MAX=str(2 * whole)) as runtime:
        small_answers = WAITING_MODEL.replace(
            "return dict(inputs)", "return {k: v[:1] for k, v in inputs.items()}"
        )
        folder = runtime.model_dir("waiting", small_answers)
        runtime.load("waiting", folder)
        runtime.load("other", runtime.model_dir("other"))
        callers = concurrent.futures.ThreadPoolExecutor(2)
        big = np.zeros(whole // 2 // 4 + 1024, dtype=np.float32)
        calls = [callers.submit(runtime.infer_fp32, "waiting", big) for _ in range(2)]
        wait_until(lambda: os.path.exists(os.path.join(folder, "begun")), timeout=10, what="a call held")
        time.sleep(0.5)  # the second one read too, queued in the worker
        runtime.mesh.unloadModel(mm.UnloadModelRequest(modelId="other"), timeout=5)
        assert runtime.mesh.modelSize(mm.ModelSizeRequest(modelId="waiting"), timeout=5).sizeInBytes > 0
        health = health_pb2_grpc.HealthStub(runtime.channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert runtime.infer.ServerLive(v2.ServerLiveRequest(), timeout=5).live
        assert not any(call.done() for call in calls)
        open(os.path.join(folder, "go"), "w").close()
        assert all(call.result(timeout=30).outputs for call in calls)


def _never_sent(release: threading.Event):
    """A client's request stream that sends nothing until `release` is set."""
    release.wait()
    yield b""


def test_silent_streams_on_server_checks_do_not_hold_up_model_meshs_calls(guarded):
    release = threading.Event()
    silent = guarded.channel.stream_unary("/inference.GRPCInferenceService/ServerLive")
    stalled = [silent.future(_never_sent(release)) for _ in range(2 * CONTROL_READS_AT_ONCE)]
    try:
        time.sleep(0.5)  # their reads begin, and more wait for room
        unknown = mm.ModelSizeRequest(modelId="never-loaded")
        expect_status(grpc.StatusCode.NOT_FOUND, guarded.mesh.modelSize, unknown, timeout=30)
        guarded.mesh.unloadModel(mm.UnloadModelRequest(modelId="never-loaded"), timeout=30)
        # Answered while the silent reads still held their room, not once they were ended.
        assert not any(call.done() for call in stalled)
    finally:
        release.set()


def test_streams_that_never_send_their_request_hold_the_control_methods_for_seconds_only(guarded):
    from runtime import reading

    release = threading.Event()
    silent = guarded.channel.stream_unary("/mmesh.ModelRuntime/modelSize")
    stalled = [silent.future(_never_sent(release)) for _ in range(CONTROL_READS_AT_ONCE)]  # all its room
    try:
        time.sleep(0.5)  # their reads begin
        # Answered (NOT_FOUND: no such model) once the silent streams' reads are refused, not never.
        unknown = mm.ModelSizeRequest(modelId="never-loaded")
        expect_status(grpc.StatusCode.NOT_FOUND, guarded.mesh.modelSize, unknown, timeout=30)
        for call in stalled:
            assert call.exception(timeout=10).code() is grpc.StatusCode.INVALID_ARGUMENT
            assert f"within {reading.CONTROL_READ_SECONDS:g} s" in call.exception().details()
        log = guarded.log()
        assert "Unexpected" not in log and "read lasted too long failed" not in log
    finally:
        release.set()


def test_streams_that_never_send_their_request_give_the_calls_room_up_once_a_call_waits():
    whole = 17825792  # GRPC_MAX_MESSAGE_BYTES: room to read two calls at once
    room = {"FRONT_BYTES_MAX": str(2 * whole), "MODEL_BYTES_MAX": str(whole)}
    with Runtime(**room, METRICS_PORT=str(free_port())) as runtime:
        runtime.load("m", runtime.model_dir("m"))
        release = threading.Event()
        silent = runtime.channel.stream_unary("/inference.GRPCInferenceService/ModelInfer")
        stalled = [silent.future(_never_sent(release), metadata=mesh_headers("m")) for _ in range(2)]
        try:
            time.sleep(0.5)  # their reads begin, and hold all the room
            assert runtime.infer_fp32("m", [2.0]).outputs  # within its 30 s, not never
            wait_until(lambda: any(call.done() for call in stalled), timeout=10, what="a silent call ended")
            ended = [call for call in stalled if call.done()]
            assert len(ended) == 1, "a silent stream was ended with no call waiting for its room"
            assert ended[0].exception().code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "had not come whole" in ended[0].exception().details()
            assert "refused a call from" in runtime.log() and "Traceback" not in runtime.log()
            counted = {"model": "m", "method": "ModelInfer"}
            metrics = scrape_metrics(runtime)
            assert metric_sample(metrics, "mesh_requests_total", code="RESOURCE_EXHAUSTED", **counted) == 1
            assert metric_sample(metrics, "mesh_requests_total", code="OK", **counted) == 1
        finally:
            release.set()


def test_response_over_the_message_limit_is_resource_exhausted_with_one_log_line():
    with Runtime(GRPC_MAX_MESSAGE_BYTES=str(4 * MiB)) as runtime:
        runtime.load("big", runtime.model_dir("big", BIG_OUTPUT_MODEL))
        error = expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, runtime.infer_fp32, "big", [5 * MiB])
        assert "over GRPC_MAX_MESSAGE_BYTES" in error.details()
        assert runtime.infer_fp32("big", [MiB]).outputs[0].shape == [MiB]
        log = runtime.log()
        assert "Traceback" not in log
        assert sum("over GRPC_MAX_MESSAGE_BYTES" in line for line in log.splitlines()) == 1
        assert runtime.worker_for("big") is not None


def test_an_abort_the_call_ended_before_ends_its_handler_as_a_cancelled_call():
    class EndedContext:
        async def abort(self, code, message):
            raise grpc.aio.InternalError("execute_batch failed: the call is over")

    with pytest.raises(asyncio.CancelledError):  # grpc logs that at debug level, not as an error
        asyncio.run(status.abort(EndedContext(), status.invalid_argument("late")))
