"""The first inference path: routing by header or field 1, forwarding bytes, status codes."""

import asyncio
import collections
import threading
import time
import types

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from harness import MiB, expect_status, mesh_headers, status_of

from protos import grpc_predict_v2_pb2 as v2
from runtime import reading
from runtime.budget import ByteBudget
from runtime.dataplane import ROUTED_HANDLERS_MAX, InferenceService

MODEL = """
    import os
    import numpy as np

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs, parameters):
            if "boom" in inputs:
                raise ValueError("the model cannot digest this")
            if "die" in inputs:
                os._exit(7)
            if "big" in inputs:
                return {"total": np.array([inputs["big"].size], dtype=np.int64)}
            return {"doubled": inputs["x"] * 2, "scale": np.array([parameters.get("scale", 1)])}

        def metadata(self):
            return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
                    "outputs": [{"name": "doubled", "datatype": "FP32", "shape": [-1, 2]}]}
"""
NON_ASCII_ID = "modèle-ñ-模型__isvc-0123456789"


@pytest.fixture(scope="module")
def served(runtime):
    path = runtime.model_dir("served", MODEL)
    for model_id in ("served", NON_ASCII_ID):
        runtime.load(model_id, path)
    yield runtime
    for model_id in ("served", NON_ASCII_ID):
        runtime.unload(model_id)


def request(model_name="served", **inputs):
    message = v2.ModelInferRequest(model_name=model_name, id="req-1")
    for name, values in inputs.items():
        array = np.asarray(values, dtype=np.float32)
        message.inputs.add(name=name, datatype="FP32", shape=array.shape).contents.fp32_contents.extend(
            array.ravel()
        )
    return message


def test_routed_by_ascii_header(served):
    answer = served.infer.ModelInfer(
        request(model_name="isvc-name", x=[[1, 2]]), metadata=[("mm-model-id", "served")]
    )
    assert list(answer.outputs[0].contents.fp32_contents) == [2, 4]
    assert answer.id == "req-1"


def test_routed_by_binary_header_with_non_ascii_id(served):
    answer = served.infer.ModelInfer(
        request(model_name="isvc-name", x=[[1, 2]]), metadata=mesh_headers(NON_ASCII_ID)
    )
    assert answer.outputs[0].name == "doubled"


def test_binary_header_wins_over_the_ascii_one(served):
    answer = served.infer.ModelInfer(
        request(model_name="isvc-name", x=[[1, 2]]),
        metadata=[("mm-model-id", "ghost"), ("mm-model-id-bin", b"served")],
    )
    assert list(answer.outputs[0].contents.fp32_contents) == [2, 4]


def test_binary_header_that_is_not_utf8_is_invalid_argument(served):
    error = expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        served.infer.ModelInfer,
        request(x=[[1, 2]]),
        metadata=[("mm-model-id-bin", b"\xff\xfe")],
    )
    assert "UTF-8" in error.details()


@pytest.mark.parametrize("header", ["mm-model-id", "mm-model-id-bin"])
def test_too_long_id_in_a_header_is_invalid_argument(served, header):
    model_id = "m" * 2000  # over modelspec.MAX_MODEL_ID_BYTES, under grpc's header limit
    error = expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        served.infer.ModelInfer,
        request(x=[[1, 2]]),
        metadata=[(header, model_id.encode() if header.endswith("-bin") else model_id)],
    )
    assert "longer" in error.details()


def test_routed_by_field_1_without_headers(served):
    answer = served.infer.ModelInfer(request(model_name=NON_ASCII_ID, x=[[3, 4]]))
    assert list(answer.outputs[0].contents.fp32_contents) == [6, 8]


def test_parameters_reach_predict(served):
    message = request(x=[[1, 2]])
    message.parameters["scale"].int64_param = 5
    answer = served.infer.ModelInfer(message)
    assert list(answer.outputs[1].contents.int64_contents) == [5]


def test_unknown_model_is_not_found(served):
    error = expect_status(
        grpc.StatusCode.NOT_FOUND, served.infer.ModelInfer, request(model_name="ghost", x=[[1, 2]])
    )
    assert "ghost" in error.details()


def test_no_model_id_anywhere_is_invalid_argument(served):
    expect_status(
        grpc.StatusCode.INVALID_ARGUMENT, served.infer.ModelInfer, request(model_name="", x=[[1, 2]])
    )


def test_malformed_request_bytes_are_invalid_argument(served):
    raw = served.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, raw, b"\x0a\xff\xff\xff", metadata=None)
    error = expect_status(
        grpc.StatusCode.INVALID_ARGUMENT, raw, b"\x0a\x06served\x2a\x03\x0a\xff", metadata=None
    )
    assert "not found" not in error.details().lower()


def test_bad_tensor_is_invalid_argument_and_not_model_not_found(served):
    message = request(x=[[1, 2]])
    message.inputs[0].shape[:] = [3, 2]
    error = expect_status(grpc.StatusCode.INVALID_ARGUMENT, served.infer.ModelInfer, message)
    assert "'x'" in error.details() and "not found" not in error.details().lower()


def test_model_raising_is_internal_with_its_message(served):
    error = expect_status(grpc.StatusCode.INTERNAL, served.infer.ModelInfer, request(boom=[1]))
    assert "cannot digest" in error.details()


def test_16_mib_request_passes(served):
    big = np.zeros(4 * MiB, dtype=np.float32)  # 16 MiB of FP32
    message = v2.ModelInferRequest(model_name="served")
    message.inputs.add(name="big", datatype="FP32", shape=[big.size])
    message.raw_input_contents.append(big.tobytes())
    answer = served.infer.ModelInfer(message, timeout=60)
    assert np.frombuffer(answer.raw_output_contents[0], dtype=np.int64)[0] == big.size


def test_model_metadata_from_the_model(served):
    answer = served.infer.ModelMetadata(v2.ModelMetadataRequest(name="served"))
    assert answer.name == "served"
    assert [(t.name, t.datatype, list(t.shape)) for t in answer.inputs] == [("x", "FP32", [-1, 2])]


def test_model_ready(served):
    assert served.infer.ModelReady(v2.ModelReadyRequest(name="served")).ready
    assert served.infer.ModelReady(
        v2.ModelReadyRequest(name="isvc"), metadata=mesh_headers(NON_ASCII_ID)
    ).ready
    expect_status(grpc.StatusCode.NOT_FOUND, served.infer.ModelReady, v2.ModelReadyRequest(name="ghost"))
    for name in ("", "m" * 2000):  # as ModelInfer answers them
        expect_status(
            grpc.StatusCode.INVALID_ARGUMENT, served.infer.ModelReady, v2.ModelReadyRequest(name=name)
        )


def test_server_live_ready_metadata(served):
    assert served.infer.ServerLive(v2.ServerLiveRequest()).live
    assert served.infer.ServerReady(v2.ServerReadyRequest()).ready
    assert served.infer.ServerMetadata(v2.ServerMetadataRequest()).name == "mesh-runtime"


def test_health_serving(served):
    answer = health_pb2_grpc.HealthStub(served.channel).Check(health_pb2.HealthCheckRequest())
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


SERVICES = ["mmesh.ModelRuntime", "inference.GRPCInferenceService", "grpc.health.v1.Health"]


def test_reflection_lists_every_service(served):
    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    (answer,) = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in answer.list_services_response.service}
    assert set(SERVICES) <= names


def test_reflection_answers_several_requests_of_a_stream_and_refuses_a_huge_one(served):
    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    asked = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=name) for name in SERVICES]
    answers = list(stub.ServerReflectionInfo(iter(asked)))
    assert [a.WhichOneof("message_response") for a in answers] == ["file_descriptor_response"] * len(SERVICES)
    huge = reflection_pb2.ServerReflectionRequest(file_containing_symbol="x" * 2**20)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.ServerReflectionInfo(iter([asked[0], huge, asked[0]])))
    assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "none over 65536" in refused.value.details()
    assert len(list(stub.ServerReflectionInfo(iter(asked)))) == len(SERVICES)  # and answers on


def test_open_reflection_streams_are_bounded_in_number_and_hold_no_other_calls_up(served):
    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    release = threading.Event()

    def one_request_then_wait():
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        release.wait(30)

    opened = [stub.ServerReflectionInfo(one_request_then_wait()) for _ in range(reading.STREAMING_CALLS_MAX)]
    try:
        for stream in opened:
            assert next(stream).list_services_response.service  # answered, and left open
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        health = health_pb2_grpc.HealthStub(served.channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # no read of its budget held
    finally:
        release.set()
    for stream in opened:
        assert list(stream) == []  # ended once its client half-closed
    assert (
        len(list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))))
        == 1
    )


def test_a_stream_whose_client_sends_nothing_for_a_while_is_ended(monkeypatch):
    monkeypatch.setattr(reading, "STREAM_IDLE_SECONDS", 0.05)

    class SilentContext:
        async def read(self):
            await asyncio.sleep(30)

        async def abort(self, code, message):
            raise grpc.aio.AbortError(f"{code.name}: {message}")

    async def next_request():
        return await reading._capped_requests(SilentContext(), None).__anext__()

    with pytest.raises(grpc.aio.AbortError, match="DEADLINE_EXCEEDED: the stream sent no message for 0.05 s"):
        asyncio.run(next_request())


def test_unknown_method_is_unimplemented(served):
    raw = served.channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")
    expect_status(grpc.StatusCode.UNIMPLEMENTED, raw, b"", metadata=mesh_headers("served"))


def test_worker_dying_mid_request_is_unavailable_then_the_model_heals(runtime):
    runtime.load("fragile", runtime.model_dir("fragile", MODEL))
    error = expect_status(
        grpc.StatusCode.UNAVAILABLE, runtime.infer.ModelInfer, request(model_name="fragile", die=[1])
    )
    assert "exit code 7" in error.details()
    answer = runtime.infer.ModelInfer(request(model_name="fragile", x=[[1, 2]]), timeout=30)
    assert list(answer.outputs[0].contents.fp32_contents) == [2, 4]
    runtime.unload("fragile")


def test_request_in_flight_during_unload_gets_not_found_not_a_hang(runtime):
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
                time.sleep(5)
                return inputs
    """,
        ),
    )
    outcome = []
    thread = threading.Thread(
        target=lambda: outcome.append(
            status_of(runtime.infer.ModelInfer, request(model_name="slow", x=[1]), timeout=30)
        )
    )
    thread.start()
    time.sleep(0.5)
    runtime.unload("slow")
    thread.join(10)
    assert not thread.is_alive()
    assert outcome == [grpc.StatusCode.NOT_FOUND]


class _RecordingDispatcher:
    """Stands in for the dispatcher behind InferenceService: records which model each call was for."""

    def __init__(self, response: bytes = b""):
        self.called: list[str] = []
        self.response = response
        self.budget = ByteBudget(per_model=MiB, total=2 * MiB, largest_request=MiB)
        self.supervisor = types.SimpleNamespace(metrics=None, is_known=lambda model_id: False)

    async def call(self, model_id, method, request, timeout):
        self.called.append(model_id)
        return self.response


def test_handlers_kept_per_header_id_are_bounded_and_never_misroute():
    details = collections.namedtuple("Details", "method invocation_metadata")
    dispatcher = _RecordingDispatcher()
    service = InferenceService(dispatcher, allow_any_method=False)
    ids = [f"model-{number}" for number in range(ROUTED_HANDLERS_MAX + 10)] + ["model-1", "model-1"]

    async def read():
        return b""

    context = types.SimpleNamespace(time_remaining=lambda: None, read=read)

    async def call_each():
        for model_id in ids:
            handler = service.service(
                details("/inference.GRPCInferenceService/ModelInfer", (("mm-model-id", model_id),))
            )
            await handler.stream_unary(iter(()), context)
            assert len(service._routed) <= ROUTED_HANDLERS_MAX

    asyncio.run(call_each())
    assert dispatcher.called == ids


@pytest.mark.parametrize("remaining, counted", [(0.004, ["DEADLINE_EXCEEDED"]), (3.0, []), (None, [])])
def test_a_call_grpc_cancels_at_its_deadline_is_counted_as_deadline_exceeded(remaining, counted):
    """grpc cancels the handler as the deadline passes, by its own clock a few milliseconds before
    time_remaining() reaches 0, and often before the dispatcher's timer: the client still sees
    DEADLINE_EXCEEDED. A call its client cancelled was never answered, and is not counted."""
    details = collections.namedtuple("Details", "method invocation_metadata")
    dispatcher, observed = _RecordingDispatcher(), []

    async def never_answered(model_id, method, request, timeout):
        await asyncio.Event().wait()

    dispatcher.call = never_answered
    dispatcher.supervisor = types.SimpleNamespace(
        metrics=types.SimpleNamespace(
            observe_call=lambda model_id, label, code, seconds: observed.append(code)
        ),
        is_known=lambda model_id: True,
    )

    async def read():
        return b""

    context = types.SimpleNamespace(time_remaining=lambda: remaining, read=read)

    async def cancelled_call():
        service = InferenceService(dispatcher, allow_any_method=False)
        handler = service.service(
            details("/inference.GRPCInferenceService/ModelInfer", (("mm-model-id", "m"),))
        )
        task = asyncio.ensure_future(handler.stream_unary(iter(()), context))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled_call())
    assert observed == counted


def test_calls_of_methods_clients_name_are_counted_under_one_label():
    labels = {
        method: InferenceService._forwarded_as(method)[1]
        for method in (
            "inference.GRPCInferenceService/ModelInfer",
            "inference.GRPCInferenceService/ModelMetadata",
            "inference.GRPCInferenceService/Anything1",
            "inference.GRPCInferenceServiceX/Anything2",
            "acme.Scorer/Score",
        )
    }
    assert labels == {
        "inference.GRPCInferenceService/ModelInfer": "ModelInfer",
        "inference.GRPCInferenceService/ModelMetadata": "ModelMetadata",
        "inference.GRPCInferenceService/Anything1": "other",
        "inference.GRPCInferenceServiceX/Anything2": "other",
        "acme.Scorer/Score": "other",
    }


def test_a_big_response_counts_against_the_byte_budget_until_its_call_ends():
    details = collections.namedtuple("Details", "method invocation_metadata")
    ends, aborted = [], []

    async def read():
        return b""

    async def abort(code, message):
        aborted.append(code)
        raise grpc.RpcError()

    context = types.SimpleNamespace(
        time_remaining=lambda: None, read=read, add_done_callback=ends.append, abort=abort
    )

    async def call(dispatcher):
        service = InferenceService(dispatcher, allow_any_method=False)
        handler = service.service(
            details("/inference.GRPCInferenceService/ModelInfer", (("mm-model-id", "m"),))
        )
        try:
            return await handler.stream_unary(iter(()), context)
        except grpc.RpcError:
            return None

    dispatcher = _RecordingDispatcher(response=b"x" * (256 * 1024))
    assert asyncio.run(call(dispatcher)) == dispatcher.response
    assert dispatcher.budget.held == 256 * 1024  # until grpc has sent it all
    ends.pop()(None)
    assert dispatcher.budget.held == 0
    too_big = _RecordingDispatcher(response=b"x" * (MiB + 1))  # past MODEL_BYTES_MAX
    assert asyncio.run(call(too_big)) is None and aborted == [grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert too_big.budget.held == 0 and ends == []


def test_health_watch_reads_its_request_under_the_budget_and_refuses_names_no_service_has(served):
    stub = health_pb2_grpc.HealthStub(served.channel)
    watching = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert next(watching).status == health_pb2.HealthCheckResponse.SERVING
    watching.cancel()
    expect_status(
        grpc.StatusCode.INVALID_ARGUMENT,
        lambda: next(stub.Watch(health_pb2.HealthCheckRequest(service="s" * 1000))),
    )
    unary_stream = grpc.unary_stream_rpc_method_handler(lambda request, context: iter(()))
    budget = ByteBudget(per_model=MiB, total=MiB, largest_request=MiB)
    assert reading.budgeted(unary_stream, budget).request_streaming  # read when the budget has room
