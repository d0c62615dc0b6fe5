"""Hostile input: garbage requests, absurd ids, rogue socket peers.

Only clear errors; the runtime keeps serving.
"""

import grpc
import numpy as np
import pytest
import zmq
from harness import MiB, expect_status, mesh_headers, status_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos import grpc_predict_v2_pb2 as v2
from workers import protocol

ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND}


@pytest.fixture(scope="module")
def echo(runtime):
    runtime.load("echo", runtime.model_dir("echo"))
    yield runtime
    runtime.unload("echo")


def _valid_request() -> bytes:
    request = v2.ModelInferRequest(model_name="echo", id="fuzz")
    request.inputs.add(name="x", datatype="FP32", shape=[2, 2]).contents.fp32_contents.extend([1, 2, 3, 4])
    request.inputs.add(name="w", datatype="BYTES", shape=[1]).contents.bytes_contents.append(b"hi")
    raw = v2.ModelInferRequest(model_name="echo")
    raw.inputs.add(name="r", datatype="INT16", shape=[3])
    raw.raw_input_contents.append(np.arange(3, dtype="<i2").tobytes())
    return request.SerializeToString() + raw.SerializeToString()[len(b"\x0a\x04echo") :]


VALID = _valid_request()


@st.composite
def mutated(draw):
    data = bytearray(VALID)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "cut", "insert", "delete"]))
        at = draw(st.integers(0, max(0, len(data) - 1)))
        if kind == "flip" and data:
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif data:
            del data[at : at + draw(st.integers(1, 8))]
    return bytes(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.one_of(st.binary(max_size=300), mutated()), with_header=st.booleans())
def test_fuzzed_model_infer_bytes_get_only_clear_answers(echo, body, with_header):
    call = echo.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    code = status_of(call, body, metadata=mesh_headers("echo") if with_header else None, timeout=10)
    assert code in ALLOWED, code


def test_runtime_serves_after_the_fuzzing(echo):
    assert echo.infer.ServerLive(v2.ServerLiveRequest()).live
    assert echo.infer_fp32("echo", [1.0]).outputs


def test_one_mib_model_id_is_invalid_argument(echo):
    call = echo.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    body = v2.ModelInferRequest(model_name="m" * MiB).SerializeToString()
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, call, body, timeout=10)


def test_empty_model_id_is_invalid_argument(echo):
    call = echo.channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")
    body = v2.ModelInferRequest().SerializeToString()
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, call, body, timeout=10)


def test_rogue_peer_on_the_worker_socket_is_ignored(echo):
    context = zmq.Context()
    rogue = context.socket(zmq.DEALER)
    rogue.setsockopt(zmq.IDENTITY, b"w1")  # pretends to be a worker
    rogue.setsockopt(zmq.LINGER, 0)
    rogue.connect(f"ipc://{echo.env['RUNTIME_DIR']}/workers.sock")
    for junk in (
        [b"\xc1"],
        [b"not msgpack", b"x"],
        [protocol.header("reply", 99999, ok=True)],
        [b"\x81\xa1v\x63"],
        [],
    ):
        if junk:
            rogue.send_multipart(junk)
    rogue.close()
    context.term()
    assert echo.infer_fp32("echo", [1.0]).outputs
    assert echo.process.poll() is None


@pytest.mark.parametrize(
    "frames",
    [
        [b""],
        [b"\xc1"],
        [b"\x90"],
        [b"\x82\xa1v\x01\xa2op\xa3zzz"],
        [b"\x83\xa1v\x02\xa2op\xa4ping\xa2id\x00"],
    ],
)
def test_malformed_headers_raise_protocol_error(frames):
    with pytest.raises(protocol.ProtocolError):
        protocol.split(frames)
