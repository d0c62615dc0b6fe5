"""The ModelInfer requests the data plane sends and the checks of what comes back.

Two payloads: FP32 [1,4] (an iris row, in typed contents) and 1 MiB (FP32 [1, 262144] in
raw_input_contents). The bodies are gRPC's length-prefixed framing of the serialised request,
as h2load sends them, with model-mesh's mm-model-id headers as HTTP/2 header lines.
"""

from __future__ import annotations

import base64
import struct

import numpy as np

from bench.common import MiB
from protos import grpc_predict_v2_pb2 as pb

METHOD = "/inference.GRPCInferenceService/ModelInfer"
BIG_ELEMENTS = MiB // 4  # FP32 [1, 262144]: 1 MiB of raw_input_contents
IRIS_ROW = [5.1, 3.5, 1.4, 0.2]  # a setosa: LogisticRegression says class 0

# The two payloads.
SMALL, BIG = "FP32 [1,4]", "1 MiB raw"


class CheckFailed(Exception):
    """A point whose responses are not what they should be: no figure is reported for it."""


def small_request(model_name: str) -> bytes:
    request = pb.ModelInferRequest(model_name=model_name)
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend(IRIS_ROW)
    return request.SerializeToString()


def big_values() -> np.ndarray:
    return (np.arange(BIG_ELEMENTS, dtype=np.float32) % 1000) / 8


def big_request(model_name: str) -> bytes:
    request = pb.ModelInferRequest(model_name=model_name)
    request.inputs.add(name="x", datatype="FP32", shape=[1, BIG_ELEMENTS])
    request.raw_input_contents.append(big_values().tobytes())
    return request.SerializeToString()


def echo_response(model_name: str, big: bool) -> bytes:
    """What the echo model answers (the canned server's fixed answer, same size)."""
    response = pb.ModelInferResponse(model_name=model_name)
    if big:
        response.outputs.add(name="x", datatype="FP32", shape=[1, BIG_ELEMENTS])
        response.raw_output_contents.append(big_values().tobytes())
    else:
        response.outputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend(IRIS_ROW)
    return response.SerializeToString()


def output_values(response: pb.ModelInferResponse, index: int = 0) -> np.ndarray:
    out = response.outputs[index]
    if response.raw_output_contents:
        dtype = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32, "FP64": np.float64}[out.datatype]
        return np.frombuffer(response.raw_output_contents[index], dtype=dtype)
    for field in ("fp32_contents", "int64_contents", "int_contents", "fp64_contents"):
        values = getattr(out.contents, field)
        if len(values):
            return np.asarray(values)
    return np.asarray([])


def expect_echo(big: bool):
    wanted = big_values() if big else np.asarray(IRIS_ROW, dtype=np.float32)

    def check(response: pb.ModelInferResponse) -> None:
        if not response.outputs:
            raise CheckFailed("the response has no output")
        got = output_values(response)
        if got.shape != wanted.shape or not np.array_equal(got.astype(np.float32), wanted):
            raise CheckFailed(f"echo returned {got[:4]}... ({got.size} values), not the input")

    return check


def expect_iris(response: pb.ModelInferResponse) -> None:
    names = [o.name for o in response.outputs]
    if "predict" not in names:
        raise CheckFailed(f"the response has outputs {names}, no 'predict'")
    got = output_values(response, names.index("predict"))
    if got.tolist() != [0]:
        raise CheckFailed(f"iris predict returned {got.tolist()}, expected [0] (setosa)")


def expect_anything(response: pb.ModelInferResponse) -> None:
    pass


def grpc_body(message: bytes) -> bytes:
    return b"\0" + struct.pack(">I", len(message)) + message


def mesh_header_lines(model_id: str) -> list[tuple[str, str]]:
    """model-mesh's headers as HTTP/2 header lines (binary values travel base64, unpadded)."""
    lines = [("mm-model-id-bin", base64.b64encode(model_id.encode()).decode().rstrip("="))]
    if all(32 <= ord(c) <= 126 for c in model_id):
        lines.append(("mm-model-id", model_id))
    return lines
