"""workers/v2.py: KServe V2 ModelInferRequest <-> numpy, without a runtime."""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest

from protos import grpc_predict_v2_pb2 as pb
from workers import responses, v2

# Independent of v2.DATATYPES on purpose: the wire format as the V2 protocol defines it.
WIRE_DTYPE = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
}
CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def raw_bytes_elements(elements) -> bytes:
    return b"".join(struct.pack("<I", len(e)) + e for e in elements)


def parse_raw_bytes_elements(data: bytes) -> list[bytes]:
    elements, offset = [], 0
    while offset < len(data):
        (length,) = struct.unpack_from("<I", data, offset)
        elements.append(data[offset + 4 : offset + 4 + length])
        offset += 4 + length
    return elements


def typed_request(*tensors) -> pb.ModelInferRequest:
    """tensors: (name, datatype, shape, contents field, values)."""
    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape, field, values in tensors:
        tensor = request.inputs.add(name=name, datatype=datatype, shape=shape)
        getattr(tensor.contents, field).extend(values)
    return request


def raw_request(*tensors) -> pb.ModelInferRequest:
    """tensors: (name, datatype, shape, raw bytes)."""
    request = pb.ModelInferRequest(model_name="m")
    for name, datatype, shape, data in tensors:
        request.inputs.add(name=name, datatype=datatype, shape=shape)
        request.raw_input_contents.append(data)
    return request


def decode_one(request: pb.ModelInferRequest) -> np.ndarray:
    inputs, _, _ = v2.decode_request(request)
    (array,) = inputs.values()
    return array


def root_base(array: np.ndarray):
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return base


def response_arrays(data: bytes) -> tuple[pb.ModelInferResponse, dict[str, np.ndarray]]:
    """Decodes a serialised ModelInferResponse by the V2 rules, without v2.py."""
    response = pb.ModelInferResponse.FromString(data)
    arrays = {}
    for index, out in enumerate(response.outputs):
        shape = tuple(out.shape)
        if response.raw_output_contents:
            raw = response.raw_output_contents[index]
            if out.datatype == "BYTES":
                array = np.array(parse_raw_bytes_elements(raw), dtype=object)
            else:
                array = np.frombuffer(raw, dtype=WIRE_DTYPE[out.datatype])
        else:
            values = list(getattr(out.contents, CONTENTS_FIELD[out.datatype]))
            array = np.array(values, dtype=object if out.datatype == "BYTES" else WIRE_DTYPE[out.datatype])
        arrays[out.name] = array.reshape(shape)
    return response, arrays


def assert_invalid_input(request, *fragments):
    with pytest.raises(v2.InvalidInput) as caught:
        v2.decode_request(request)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from {message!r}"
    assert "not found" not in message.lower()


# --- decoding typed contents -------------------------------------------------

TYPED_CASES = [
    ("BOOL", [True, False, False, True], np.bool_),
    ("UINT8", [0, 255, 1, 128], np.uint8),
    ("UINT16", [0, 65535, 1, 300], np.uint16),
    ("UINT32", [0, 2**32 - 1, 1, 70000], np.uint32),
    ("UINT64", [0, 2**64 - 1, 1, 2**40], np.uint64),
    ("INT8", [-128, 127, 0, -1], np.int8),
    ("INT16", [-32768, 32767, 0, -1], np.int16),
    ("INT32", [-(2**31), 2**31 - 1, 0, -1], np.int32),
    ("INT64", [-(2**63), 2**63 - 1, 0, -1], np.int64),
    ("FP32", [0.5, -1.25, 2.0**100, 0.0], np.float32),
    ("FP64", [0.1, -1e300, 5e-324, 0.0], np.float64),
    ("BYTES", [b"abc", b"", b"\x00\xff", "ü".encode()], object),
]


@pytest.mark.parametrize("datatype, values, dtype", TYPED_CASES, ids=[c[0] for c in TYPED_CASES])
def test_typed_contents_decode_to_dtype_shape_and_values(datatype, values, dtype):
    request = typed_request(("x", datatype, [2, 2], CONTENTS_FIELD[datatype], values))
    inputs, parameters, raw = v2.decode_request(request)
    array = inputs["x"]
    assert raw is False
    assert parameters == {}
    assert array.dtype == np.dtype(dtype)
    assert array.shape == (2, 2)
    assert array.ravel().tolist() == values


def test_typed_scalar_and_empty_shapes():
    request = typed_request(
        ("scalar", "INT32", [], "int_contents", [7]), ("empty", "FP32", [0, 3], "fp32_contents", [])
    )
    inputs, _, _ = v2.decode_request(request)
    assert inputs["scalar"].shape == () and inputs["scalar"].item() == 7
    assert inputs["empty"].shape == (0, 3) and inputs["empty"].dtype == np.float32


# --- decoding raw_input_contents ----------------------------------------------


def _numeric_sample(dtype: np.dtype) -> np.ndarray:
    if dtype == np.bool_:
        return np.array([True, False, True, True, False, False])
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return np.array([info.min, info.max, 0, 1, 2, 3], dtype=dtype)
    info = np.finfo(dtype)
    return np.array([-1.5, 0.0, 2.25, info.max, info.tiny, -np.inf], dtype=dtype)


@pytest.mark.parametrize("datatype", list(WIRE_DTYPE))
def test_raw_numeric_decodes_without_copying(datatype):
    expected = _numeric_sample(WIRE_DTYPE[datatype]).reshape(2, 3)
    request = raw_request(("x", datatype, [2, 3], expected.tobytes()))
    inputs, _, raw = v2.decode_request(request)
    array = inputs["x"]
    assert raw is True
    assert array.dtype == WIRE_DTYPE[datatype]
    assert array.shape == (2, 3)
    np.testing.assert_array_equal(array, expected)
    assert not array.flags.owndata
    assert isinstance(root_base(array), bytes)


def test_raw_numbers_are_little_endian():
    request = raw_request(("x", "INT32", [2], b"\x01\x00\x00\x00\x00\x01\x00\x00"))
    assert decode_one(request).tolist() == [1, 256]


def test_raw_bf16_arrives_widened_to_float32():
    expected = np.array([1.0, -2.5, 3.140625, 0.0, -np.inf, 65280.0], dtype=np.float32)
    bf16 = (expected.view(np.uint32) >> 16).astype("<u2")
    array = decode_one(raw_request(("x", "BF16", [3, 2], bf16.tobytes())))
    assert array.dtype == np.float32
    assert array.shape == (3, 2)
    np.testing.assert_array_equal(array, expected.reshape(3, 2))


def test_raw_bytes_elements_are_length_prefixed():
    elements = [b"abc", b"", b"\x00\x01", "ü".encode()]
    array = decode_one(raw_request(("x", "BYTES", [2, 2], raw_bytes_elements(elements))))
    assert array.dtype == object
    assert array.shape == (2, 2)
    assert array.ravel().tolist() == elements


@pytest.mark.parametrize("elements", [[], [b""] * 5, [bytes([n % 251]) * (n % 7) for n in range(1000)]])
def test_raw_bytes_elements_of_any_count_and_length_come_back_as_sent(elements):
    array = decode_one(raw_request(("x", "BYTES", [len(elements)], raw_bytes_elements(elements))))
    assert array.shape == (len(elements),)
    assert all(type(element) is bytes for element in array)
    assert array.tolist() == elements


def test_raw_bool_bytes_other_than_0_and_1_are_true():
    array = decode_one(raw_request(("x", "BOOL", [4], bytes([0, 1, 2, 255]))))
    assert array.dtype == np.bool_ and array.tobytes() == bytes([0, 1, 1, 1])


def test_an_input_with_contents_in_a_request_with_raw_input_contents_is_invalid_input():
    request = raw_request(("x", "FP32", [1], np.float32(1.0).tobytes()))
    request.inputs[0].contents.fp32_contents.append(2.0)
    with pytest.raises(v2.InvalidInput, match="has contents, and the request raw_input_contents"):
        v2.decode_request(request)
    del request.inputs[0].contents.fp32_contents[:]  # present but empty, as some clients send it
    assert decode_one(request).tolist() == [1.0]


def test_raw_inputs_keep_their_order_and_names():
    a = np.arange(3, dtype="<i4")
    b = np.array([0.5, 1.5], dtype="<f8")
    request = raw_request(("a", "INT32", [3], a.tobytes()), ("b", "FP64", [2], b.tobytes()))
    inputs, _, _ = v2.decode_request(request)
    assert list(inputs) == ["a", "b"]
    np.testing.assert_array_equal(inputs["a"], a)
    np.testing.assert_array_equal(inputs["b"], b)


# --- request errors -----------------------------------------------------------

ERROR_CASES = [
    pytest.param(
        typed_request(("x", "FP8", [1], "fp32_contents", [1.0])),
        ("'x'", "unknown datatype", "FP8"),
        id="unknown-datatype-typed",
    ),
    pytest.param(
        raw_request(("x", "COMPLEX64", [1], b"\0" * 8)),
        ("'x'", "unknown datatype", "COMPLEX64"),
        id="unknown-datatype-raw",
    ),
    pytest.param(
        typed_request(("x", "INT32", [2, 3], "int_contents", [1, 2, 3, 4, 5])),
        ("'x'", "needs 6 values", "got 5"),
        id="shape-contents-mismatch",
    ),
    pytest.param(
        typed_request(("x", "INT32", [2], "fp32_contents", [1.0, 2.0])),
        ("'x'", "int_contents", "got 0"),
        id="contents-in-wrong-field",
    ),
    pytest.param(
        raw_request(("x", "FP32", [3], b"\0" * 8)), ("'x'", "12 bytes", "has 8"), id="raw-length-mismatch"
    ),
    pytest.param(
        raw_request(("x", "FP16", [2], b"\0" * 5)), ("'x'", "4 bytes", "has 5"), id="raw-fp16-length-mismatch"
    ),
    pytest.param(
        pb.ModelInferRequest(
            inputs=[
                pb.ModelInferRequest.InferInputTensor(name="x", datatype="INT8", shape=[1]),
                pb.ModelInferRequest.InferInputTensor(name="y", datatype="INT8", shape=[1]),
            ],
            raw_input_contents=[b"\x01"],
        ),
        ("raw_input_contents", "1 entries", "2 inputs"),
        id="raw-count-below-inputs",
    ),
    pytest.param(
        pb.ModelInferRequest(
            inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="INT8", shape=[1])],
            raw_input_contents=[b"\x01", b"\x02"],
        ),
        ("raw_input_contents", "2 entries", "1 inputs"),
        id="raw-count-above-inputs",
    ),
    pytest.param(
        typed_request(("x", "INT32", [1], "int_contents", [1]), ("x", "INT32", [1], "int_contents", [2])),
        ("'x'", "twice"),
        id="duplicate-name",
    ),
    pytest.param(
        typed_request(("x", "INT32", [2, -1], "int_contents", [1, 2])),
        ("'x'", "negative"),
        id="negative-dimension",
    ),
    pytest.param(
        raw_request(("x", "BYTES", [1], b"\x03\x00")), ("'x'", "cut short"), id="raw-bytes-truncated-header"
    ),
    pytest.param(
        raw_request(("x", "BYTES", [1], b"\x05\x00\x00\x00ab")),
        ("'x'", "past the end"),
        id="raw-bytes-truncated-element",
    ),
    pytest.param(
        raw_request(("x", "BYTES", [3], raw_bytes_elements([b"a", b"b"]))),
        ("'x'", "3 BYTES elements", "2"),
        id="raw-bytes-element-count",
    ),
    pytest.param(
        raw_request(("x", "BYTES", [1], raw_bytes_elements([b"a", b"b"]))),
        ("'x'", "1 BYTES elements", "more"),
        id="raw-bytes-more-elements-than-the-shape",
    ),
    pytest.param(
        raw_request(("x", "BYTES", [3], raw_bytes_elements([b"a", b"b"]) + b"\x01")),
        ("'x'", "cut short", "byte 10"),
        id="raw-bytes-header-cut-short-after-whole-elements",
    ),
    pytest.param(
        raw_request(("x", "BYTES", [2], raw_bytes_elements([b"", b""]) + b"\x01\x00")),
        ("'x'", "2 BYTES elements", "2 bytes after"),
        id="raw-bytes-bytes-after-the-shapes-count",
    ),
    pytest.param(
        typed_request(("x", "FP16", [1], "fp32_contents", [1.0])),
        ("'x'", "FP16", "raw_input_contents"),
        id="fp16-typed",
    ),
    pytest.param(
        typed_request(("x", "BF16", [1], "fp32_contents", [1.0])),
        ("'x'", "BF16", "raw_input_contents"),
        id="bf16-typed",
    ),
]


@pytest.mark.parametrize("request_, fragments", ERROR_CASES)
def test_invalid_requests_raise_invalid_input_naming_the_problem(request_, fragments):
    assert_invalid_input(request_, *fragments)


HUGE_SHAPE_CASES = [
    pytest.param(raw_request(("x", "FP32", [10**6, 10**6], b"\0" * 4)), ("'x'", "bytes"), id="raw-fp32"),
    pytest.param(
        raw_request(("x", "BYTES", [10**6, 10**6], raw_bytes_elements([b"a"]))),
        ("'x'", "BYTES"),
        id="raw-bytes",
    ),
    pytest.param(
        typed_request(("x", "INT64", [10**6, 10**6], "int64_contents", [1])),
        ("'x'", "values"),
        id="typed-int64",
    ),
    pytest.param(
        typed_request(("x", "BYTES", [10**6, 10**6], "bytes_contents", [b"a"])),
        ("'x'", "values"),
        id="typed-bytes",
    ),
    pytest.param(
        raw_request(("x", "UINT8", [2**21, 2**20], b"\0")), ("'x'", "more than"), id="over-max-elements"
    ),
    pytest.param(
        raw_request(("x", "UINT8", [2**62, 2**62, 2**62], b"\0")),
        ("'x'", "more than"),
        id="product-past-int64",
    ),
    pytest.param(
        raw_request(("x", "FP32", [0, 2**62], b"")), ("'x'", "dimension of more than"), id="zero-beside-huge"
    ),
    pytest.param(
        raw_request(("x", "BYTES", [0, 2**61], b"")),
        ("'x'", "dimension of more than"),
        id="bytes-zero-beside-huge",
    ),
    pytest.param(
        raw_request(("x", "FP32", [1] * 65, b"\0" * 4)), ("'x'", "65 dimensions"), id="65-dimensions"
    ),
]


@pytest.mark.parametrize("request_, fragments", HUGE_SHAPE_CASES)
def test_huge_shape_with_tiny_data_fails_without_allocating(request_, fragments):
    tracemalloc.start()
    try:
        assert_invalid_input(request_, *fragments)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


@pytest.mark.parametrize(
    "datatype, field, value",
    [
        pytest.param("INT8", "int_contents", 300, id="INT8-300"),
        pytest.param("INT8", "int_contents", -129, id="INT8--129"),
        pytest.param("UINT8", "uint_contents", 256, id="UINT8-256"),
        pytest.param("INT16", "int_contents", 40000, id="INT16-40000"),
        pytest.param("UINT16", "uint_contents", 70000, id="UINT16-70000"),
    ],
)
def test_typed_value_out_of_range_is_invalid_input(datatype, field, value):
    assert_invalid_input(typed_request(("x", datatype, [2], field, [1, value])), "'x'", datatype)


# --- parameters -----------------------------------------------------------------


def test_request_parameters_decode_to_plain_python_values():
    request = typed_request(("x", "INT32", [1], "int_contents", [1]))
    request.parameters["flag"].bool_param = True
    request.parameters["off"].bool_param = False
    request.parameters["count"].int64_param = -(2**40)
    request.parameters["label"].string_param = "é-label"
    _, parameters, _ = v2.decode_request(request)
    assert parameters == {"flag": True, "off": False, "count": -(2**40), "label": "é-label"}
    assert type(parameters["flag"]) is bool and type(parameters["off"]) is bool
    assert type(parameters["count"]) is int
    assert type(parameters["label"]) is str


def test_no_parameters_decode_to_empty_dict():
    _, parameters, _ = v2.decode_request(pb.ModelInferRequest(model_name="m"))
    assert parameters == {}


# --- encode_response ------------------------------------------------------------

NUMERIC_OUTPUTS = [
    (np.bool_, "BOOL"),
    (np.uint8, "UINT8"),
    (np.uint16, "UINT16"),
    (np.uint32, "UINT32"),
    (np.uint64, "UINT64"),
    (np.int8, "INT8"),
    (np.int16, "INT16"),
    (np.int32, "INT32"),
    (np.int64, "INT64"),
    (np.float32, "FP32"),
    (np.float64, "FP64"),
]


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
@pytest.mark.parametrize("dtype, datatype", NUMERIC_OUTPUTS, ids=[d for _, d in NUMERIC_OUTPUTS])
def test_numeric_outputs_round_trip(dtype, datatype, raw):
    value = _numeric_sample(np.dtype(dtype)).reshape(3, 2)
    data = responses.encode_response(pb.ModelInferRequest(model_name="m"), {"y": value}, raw)
    response, arrays = response_arrays(data)
    (out,) = response.outputs
    assert (out.name, out.datatype, list(out.shape)) == ("y", datatype, [3, 2])
    assert len(response.raw_output_contents) == (1 if raw else 0)
    if raw:
        assert not out.HasField("contents")
    np.testing.assert_array_equal(arrays["y"], value)


CANONICAL_OUTPUTS = [
    pytest.param({"y": np.array([5.1, 3.5, 1.4, 0.2], np.float32).reshape(1, 4)}, id="fp32-row"),
    pytest.param({"y": np.linspace(-1, 1, 1000)}, id="fp64-1000"),
    pytest.param({"y": np.arange(6, dtype=">f4").reshape(2, 3)}, id="fp32-big-endian"),
    pytest.param({"y": np.array(2.5)}, id="scalar"),
    pytest.param({"y": np.zeros((2, 0), np.float32)}, id="empty"),
    pytest.param({"y": np.array([[-3, 2**40]], np.int64), "p": np.array([0.25], np.float32)}, id="two"),
    pytest.param({"y": np.array([True, False]), "n": np.array([-1, 300], np.int16)}, id="bool-int16"),
    pytest.param({"y": np.array([0, 2, 127], np.int64), "u": np.array([128, 0], np.uint8)}, id="labels"),
    pytest.param({"y": np.array([[1, 0]], np.uint64), "n": np.zeros((0, 3), np.int32)}, id="uint64-empty"),
    pytest.param({"y": np.array([b"a", "ü".encode()], dtype=object)}, id="bytes"),
    pytest.param({"y": np.arange(3, dtype=np.float16)}, id="fp16"),
]


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
@pytest.mark.parametrize("outputs", CANONICAL_OUTPUTS)
def test_response_is_written_as_protobuf_writes_it(outputs, raw):
    """Written by hand, the response is byte for byte what protobuf would serialise."""
    request = pb.ModelInferRequest(model_name="m" * 200, model_version="", id="req-ü")
    data = responses.encode_response(request, outputs, raw)
    response, arrays = response_arrays(data)
    assert response.SerializeToString() == data
    for name, value in outputs.items():
        np.testing.assert_array_equal(arrays[name], value)


def test_kept_tensor_heads_stay_bounded_and_right():
    """Each (name, datatype, shape) keeps its written bytes; a model of ever new shapes must not grow them."""
    for rows in range(responses.HEADS_MAX + 10):
        value = np.zeros((rows, 2), np.float32)
        data = responses.encode_response(pb.ModelInferRequest(), {"y": value}, False)
        assert response_arrays(data)[1]["y"].shape == (rows, 2)
        assert len(responses._heads) <= responses.HEADS_MAX


def test_heads_of_long_output_names_are_written_but_not_kept():
    """A model naming its outputs after a client's inputs must not keep what a client sent."""
    responses._heads.clear()
    long_name = "n" * (responses.HEAD_NAME_KEPT_MAX + 1)
    for name in (long_name, "y"):
        data = responses.encode_response(pb.ModelInferRequest(), {name: np.zeros(2, np.float32)}, False)
        assert list(response_arrays(data)[1]) == [name]
    assert [key[0] for key in responses._heads] == ["y"]


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_big_endian_output_is_sent_as_its_little_endian_datatype(raw):
    value = np.array([1, -2, 2**30], dtype=">i4")
    response, arrays = response_arrays(responses.encode_response(pb.ModelInferRequest(), {"y": value}, raw))
    assert response.outputs[0].datatype == "INT32"
    assert arrays["y"].tolist() == [1, -2, 2**30]


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_bytes_and_str_outputs_round_trip_as_bytes(raw):
    outputs = {
        "objects": np.array([[b"abc", b""], [b"\x00\xff", b"z"]], dtype=object),
        "strings": np.array(["ü", "plain"]),
        "fixed": np.array([b"ab", b"c"], dtype="S2"),
        "mixed": np.array(["s", b"b"], dtype=object),
    }
    response, arrays = response_arrays(responses.encode_response(pb.ModelInferRequest(), outputs, raw))
    assert {o.name: o.datatype for o in response.outputs} == dict.fromkeys(outputs, "BYTES")
    assert len(response.raw_output_contents) == (len(outputs) if raw else 0)
    assert arrays["objects"].shape == (2, 2)
    assert arrays["objects"].tolist() == [[b"abc", b""], [b"\x00\xff", b"z"]]
    assert arrays["strings"].tolist() == ["ü".encode(), b"plain"]
    assert arrays["fixed"].tolist() == [b"ab", b"c"]
    assert arrays["mixed"].tolist() == [b"s", b"b"]


@pytest.mark.parametrize(
    "count, longest",
    [
        (responses._INTERLEAVE_FROM - 1, 300),
        (responses._INTERLEAVE_FROM, 300),  # on average past _INTERLEAVE_BELOW_BYTES
        (1000, 300),
        (1000, 10),
    ],
)
def test_raw_bytes_outputs_of_any_count_and_length_round_trip(count, longest):
    elements = [bytes([n % 256]) * (n % longest) for n in range(count - 1)] + [b"\x01" * 70_000]
    value = np.empty((count,), dtype=object)
    value[:] = elements
    response, arrays = response_arrays(responses.encode_response(pb.ModelInferRequest(), {"y": value}, True))
    assert len(response.raw_output_contents[0]) == 4 * count + sum(map(len, elements))
    assert arrays["y"].tolist() == elements


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_object_output_of_numpy_text_scalars_is_bytes(raw):
    value = np.array([np.str_("ü"), np.bytes_(b"b"), "", b""], dtype=object)
    response, arrays = response_arrays(responses.encode_response(pb.ModelInferRequest(), {"y": value}, raw))
    assert response.outputs[0].datatype == "BYTES"
    assert arrays["y"].tolist() == ["ü".encode(), b"b", b"", b""]


OBJECT_OUTPUT_ERRORS = [
    pytest.param(np.array([1, "a", None], dtype=object), "int", "0", id="int-first"),
    pytest.param(np.array(["a", b"b", None], dtype=object), "NoneType", "2", id="None-last"),
    pytest.param(np.array([[b"a", "b"], ["c", 2.5]], dtype=object), "float", "(1, 1)", id="2-D"),
    pytest.param(np.array([b"a", np.int64(3)], dtype=object), "int64", "1", id="numpy-int"),
    pytest.param(np.array([b"a", bytearray(b"b")], dtype=object), "bytearray", "1", id="bytearray"),
    pytest.param(np.array([b"a"] * 99 + [None], dtype=object), "NoneType", "99", id="None-after-bytes"),
    pytest.param(np.array({"k": "v"}, dtype=object), "dict", "0", id="0-D"),
]


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
@pytest.mark.parametrize("value, kind, index", OBJECT_OUTPUT_ERRORS)
def test_object_output_holding_anything_but_text_is_bad_model_output(value, kind, index, raw):
    outputs = {"fine": np.array([1.5]), "y": value}
    with pytest.raises(responses.BadModelOutput) as caught:
        responses.encode_response(pb.ModelInferRequest(), outputs, raw)
    assert str(caught.value) == (
        f"output 'y' holds {kind} at index {index}; an object output must hold bytes or str"
    )


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_object_output_str_that_utf8_cannot_encode_is_bad_model_output(raw):
    with pytest.raises(
        responses.BadModelOutput, match="output 'y' holds a str at index 1 that UTF-8 cannot encode"
    ):
        responses.encode_response(pb.ModelInferRequest(), {"y": np.array(["a", "\ud800"], dtype=object)}, raw)


def test_bad_object_output_that_was_not_requested_is_not_checked():
    request = pb.ModelInferRequest(outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="ok")])
    outputs = {"ok": np.array([b"x"], dtype=object), "junk": np.array([None], dtype=object)}
    response, arrays = response_arrays(responses.encode_response(request, outputs, False))
    assert [o.name for o in response.outputs] == ["ok"] and arrays["ok"].tolist() == [b"x"]


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_requested_outputs_select_and_order(raw):
    request = pb.ModelInferRequest(
        outputs=[
            pb.ModelInferRequest.InferRequestedOutputTensor(name="c"),
            pb.ModelInferRequest.InferRequestedOutputTensor(name="a"),
        ]
    )
    outputs = {"a": np.array([1], np.int32), "b": np.array([2], np.int32), "c": np.array([3.5], np.float64)}
    response, arrays = response_arrays(responses.encode_response(request, outputs, raw))
    assert [o.name for o in response.outputs] == ["c", "a"]
    assert arrays["c"].tolist() == [3.5] and arrays["a"].tolist() == [1]


def test_all_outputs_in_model_order_when_none_requested():
    outputs = {"z": np.array([1], np.int8), "a": np.array([2], np.int8)}
    response, _ = response_arrays(responses.encode_response(pb.ModelInferRequest(), outputs, False))
    assert [o.name for o in response.outputs] == ["z", "a"]


def test_unknown_requested_output_is_invalid_input():
    request = pb.ModelInferRequest(outputs=[pb.ModelInferRequest.InferRequestedOutputTensor(name="nope")])
    with pytest.raises(v2.InvalidInput) as caught:
        responses.encode_response(request, {"y": np.array([1])}, False)
    message = str(caught.value)
    assert "'nope'" in message
    assert "not found" not in message.lower()


def test_float16_output_forces_a_raw_response():
    outputs = {"i": np.array([1, 2], np.int32), "h": np.array([0.5, -2.0], np.float16)}
    response, arrays = response_arrays(responses.encode_response(pb.ModelInferRequest(), outputs, False))
    assert [(o.name, o.datatype) for o in response.outputs] == [("i", "INT32"), ("h", "FP16")]
    assert len(response.raw_output_contents) == 2
    assert not any(o.HasField("contents") for o in response.outputs)
    assert arrays["i"].tolist() == [1, 2]
    assert arrays["h"].dtype == np.float16 and arrays["h"].tolist() == [0.5, -2.0]


@pytest.mark.parametrize(
    "value",
    [np.array([1 + 2j]), np.array(["2024-01-01"], dtype="datetime64[D]")],
    ids=["complex", "datetime64"],
)
def test_unsupported_output_dtype_is_bad_model_output(value):
    with pytest.raises(responses.BadModelOutput, match="'y'"):
        responses.encode_response(pb.ModelInferRequest(), {"y": value}, False)


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
@pytest.mark.parametrize(
    "name, message",
    [
        (0, "output name 0 is of type int; V2 names outputs with str"),
        (None, "output name None is of type NoneType; V2 names outputs with str"),
        (b"\xff", "output name b'\\xff' is not UTF-8"),
        ("a\ud800", "output name 'a\\ud800' cannot be written in UTF-8 (surrogates not allowed)"),
    ],
    ids=["int", "None", "bad-bytes", "surrogate"],
)
def test_output_name_that_v2_cannot_carry_is_bad_model_output(name, message, raw):
    with pytest.raises(responses.BadModelOutput) as caught:
        responses.encode_response(pb.ModelInferRequest(), {name: np.array([1.0])}, raw)
    assert str(caught.value) == message


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_output_named_by_utf8_bytes_is_named_by_their_text(raw):
    data = responses.encode_response(pb.ModelInferRequest(), {"ü".encode(): np.array([1.0])}, raw)
    response, arrays = response_arrays(data)
    assert response.outputs[0].name == "ü" and arrays["ü"].tolist() == [1.0]


@pytest.mark.parametrize(
    "outputs", [[np.array([1])], np.array([1]), None, "y"], ids=["list", "ndarray", "None", "str"]
)
def test_non_dict_outputs_are_bad_model_output(outputs):
    with pytest.raises(responses.BadModelOutput, match="dict"):
        responses.encode_response(pb.ModelInferRequest(), outputs, False)


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_response_echoes_model_name_version_and_id(raw):
    request = pb.ModelInferRequest(model_name="モデル-ü__isvc-1", model_version="3", id="req-42")
    response, _ = response_arrays(responses.encode_response(request, {"y": np.array([1.0])}, raw))
    assert (response.model_name, response.model_version, response.id) == ("モデル-ü__isvc-1", "3", "req-42")


@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_decoded_request_round_trips_through_encode(raw):
    value = np.arange(6, dtype=np.int16).reshape(2, 3)
    if raw:
        request = raw_request(("x", "INT16", [2, 3], value.tobytes()))
    else:
        request = typed_request(("x", "INT16", [2, 3], "int_contents", value.ravel().tolist()))
    inputs, _, was_raw = v2.decode_request(request)
    assert was_raw is raw
    response, arrays = response_arrays(responses.encode_response(request, inputs, was_raw))
    assert len(response.raw_output_contents) == (1 if raw else 0)
    np.testing.assert_array_equal(arrays["x"], value)


# --- metadata_response ----------------------------------------------------------


def test_metadata_response_from_dict():
    metadata = {
        "versions": [1, "2"],
        "platform": "onnx",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 3]}],
        "outputs": [{"name": "y", "datatype": "INT64"}, {"name": "z", "datatype": "BYTES", "shape": [1]}],
    }
    response = pb.ModelMetadataResponse.FromString(responses.metadata_response("m-1", "sklearn", metadata))
    assert response.name == "m-1"
    assert list(response.versions) == ["1", "2"]
    assert response.platform == "onnx"
    assert [(t.name, t.datatype, list(t.shape)) for t in response.inputs] == [("x", "FP32", [-1, 3])]
    assert [(t.name, t.datatype, list(t.shape)) for t in response.outputs] == [
        ("y", "INT64", []),
        ("z", "BYTES", [1]),
    ]


@pytest.mark.parametrize("metadata", [None, {}], ids=["None", "empty"])
def test_metadata_response_without_metadata(metadata):
    response = pb.ModelMetadataResponse.FromString(responses.metadata_response("m-1", "sklearn", metadata))
    assert response.name == "m-1"
    assert response.platform == "sklearn"
    assert list(response.versions) == []
    assert len(response.inputs) == 0 and len(response.outputs) == 0


def test_the_rehearsal_requests_decode_typed_and_raw_and_encode_back():
    seen_raw = []
    for request_bytes in v2.sample_requests():
        request = pb.ModelInferRequest.FromString(request_bytes)
        inputs, _, raw = v2.decode_request(request)
        assert inputs["x"].shape == (1, 4) and not inputs["x"].any()
        assert pb.ModelInferResponse.FromString(responses.encode_response(request, inputs, raw)).outputs
        seen_raw.append(raw)
    assert sorted(seen_raw) == [False, True]
