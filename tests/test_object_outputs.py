"""A model's object outputs end to end: text travels as BYTES, anything else fails the call as its error."""

import grpc
import numpy as np
import pytest
from harness import expect_status, mesh_headers

from protos import grpc_predict_v2_pb2 as v2

# Answers with the object array its input's first value picks.
OBJECTS = """
    import numpy as np

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            if inputs["x"].ravel()[0] == 0:
                return {"y": np.array(["é", b"b"], dtype=object)}
            return {"y": np.array([1, "a", None], dtype=object)}
"""
MESSAGE = "output 'y' holds int at index 0; an object output must hold bytes or str"


def request(value: float, raw: bool) -> v2.ModelInferRequest:
    message = v2.ModelInferRequest(model_name="objects")
    tensor = message.inputs.add(name="x", datatype="FP32", shape=[1])
    if raw:
        message.raw_input_contents.append(np.array([value], dtype="<f4").tobytes())
    else:
        tensor.contents.fp32_contents.append(value)
    return message


@pytest.fixture(scope="module")
def objects(runtime):
    runtime.load("objects", runtime.model_dir("objects", OBJECTS))
    yield runtime
    runtime.unload("objects")


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_object_output_of_text_is_bytes(objects, raw):
    response = objects.infer.ModelInfer(request(0, raw), metadata=mesh_headers("objects"), timeout=30)
    (out,) = response.outputs
    assert out.datatype == "BYTES" and list(out.shape) == [2]
    if raw:
        assert response.raw_output_contents[0] == b"\x02\x00\x00\x00\xc3\xa9\x01\x00\x00\x00b"
    else:
        assert list(out.contents.bytes_contents) == ["é".encode(), b"b"]


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_object_output_holding_an_int_fails_internal_naming_it(objects, raw):
    error = expect_status(
        grpc.StatusCode.INTERNAL,
        objects.infer.ModelInfer,
        request(1, raw),
        metadata=mesh_headers("objects"),
        timeout=30,
    )
    assert MESSAGE in error.details()
    # The model's error, not the worker's: it still serves.
    objects.infer.ModelInfer(request(0, raw), metadata=mesh_headers("objects"), timeout=30)
