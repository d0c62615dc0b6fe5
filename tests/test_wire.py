"""runtime/wire.py: reading field 1 (the model id) from serialised requests without parsing them."""

from __future__ import annotations

import pytest

from protos import grpc_predict_v2_pb2 as pb
from protos import wire

MiB = 1024 * 1024
MODEL_IDS = ["m", "sklearn-iris__isvc-6b2eb0b8bf", "モデル-ü__isvc-1", "x" * 300]


def varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def infer_request(model_id: str) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model_id, model_version="7", id="req-1")
    request.parameters["flag"].bool_param = True
    tensor = request.inputs.add(name="input-0", datatype="FP32", shape=[1, 2])
    tensor.contents.fp32_contents.extend([1.0, 2.0])
    request.outputs.add(name="output-0")
    return request


@pytest.fixture(scope="module")
def big_raw_contents() -> bytes:
    return bytes(range(256)) * (16 * MiB // 256)


@pytest.mark.parametrize("model_id", MODEL_IDS)
@pytest.mark.parametrize(
    "build",
    [
        infer_request,
        lambda model_id: pb.ModelMetadataRequest(name=model_id, version="2"),
        lambda model_id: pb.ModelReadyRequest(name=model_id, version="2"),
    ],
    ids=["ModelInferRequest", "ModelMetadataRequest", "ModelReadyRequest"],
)
def test_model_name_from_serialised_request(build, model_id):
    assert wire.string_field(build(model_id).SerializeToString(), 1) == model_id


def test_other_string_fields_of_an_infer_request():
    data = infer_request("m").SerializeToString()
    assert wire.string_field(data, 2) == "7"
    assert wire.string_field(data, 3) == "req-1"


def test_model_name_after_16_mib_of_raw_input_contents(big_raw_contents):
    model_id = "モデル-ü__isvc-1"
    data = (
        pb.ModelInferRequest(raw_input_contents=[big_raw_contents]).SerializeToString()
        + pb.ModelInferRequest(model_name=model_id).SerializeToString()
    )
    assert data.index(model_id.encode()) > 16 * MiB
    parsed = pb.ModelInferRequest.FromString(data)
    assert parsed.model_name == model_id and parsed.raw_input_contents[0] == big_raw_contents
    assert wire.string_field(data, 1) == model_id


def test_model_name_before_16_mib_of_raw_input_contents(big_raw_contents):
    model_id = "モデル-ü__isvc-1"
    data = pb.ModelInferRequest(
        model_name=model_id, raw_input_contents=[big_raw_contents]
    ).SerializeToString()
    assert len(data) > 16 * MiB
    assert wire.string_field(data, 1) == model_id


def test_absent_field_after_16_mib_is_none(big_raw_contents):
    data = pb.ModelInferRequest(model_version="1", raw_input_contents=[big_raw_contents]).SerializeToString()
    assert wire.string_field(data, 1) is None


def test_every_skippable_wire_type_before_field_1():
    data = (
        varint(9 << 3 | 0)
        + varint(2**63)
        + varint(10 << 3 | 1)
        + b"\xff" * 8
        + varint(11 << 3 | 5)
        + b"\xff" * 4
        + length_delimited(12, b"\x0a\x03bad")
        + length_delimited(1, "ü".encode())
    )
    assert wire.string_field(data, 1) == "ü"


def test_field_1_with_another_wire_type_is_skipped():
    data = varint(1 << 3 | 0) + varint(5) + length_delimited(1, b"name")
    assert wire.string_field(data, 1) == "name"


def test_first_occurrence_wins_when_field_repeats():
    data = length_delimited(1, b"first") + length_delimited(1, b"second")
    assert wire.string_field(data, 1) == "first"


def test_field_1_of_a_nested_message_is_not_top_level():
    request = pb.ModelInferRequest(model_version="1")
    request.inputs.add(name="inner", datatype="INT8", shape=[1])
    request.outputs.add(name="inner-out")
    assert wire.string_field(request.SerializeToString(), 1) is None


@pytest.mark.parametrize(
    "data",
    [
        b"",
        pb.ModelInferRequest().SerializeToString(),
        pb.ModelInferRequest(model_name="").SerializeToString(),
        pb.ModelInferRequest(model_version="1", id="x").SerializeToString(),
        pb.ModelReadyRequest(version="3").SerializeToString(),
    ],
    ids=["empty-bytes", "empty-message", "empty-name", "other-fields", "ready-without-name"],
)
def test_absent_field_is_none(data):
    assert wire.string_field(data, 1) is None


def test_empty_string_field_present_on_the_wire_is_empty_string():
    assert wire.string_field(length_delimited(1, b""), 1) == ""


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"\x80", id="truncated-key"),
        pytest.param(b"\x08", id="missing-varint-value"),
        pytest.param(b"\x08\x80\x80", id="truncated-varint-value"),
        pytest.param(b"\x0a", id="missing-length"),
        pytest.param(b"\x0a\x80", id="truncated-length"),
        pytest.param(b"\x08" + b"\xff" * 10 + b"\x01", id="overlong-varint"),
        pytest.param(b"\x0a\x05abc", id="length-past-end"),
        pytest.param(b"\x12\x05abc", id="other-field-length-past-end"),
        pytest.param(b"\x0a" + varint(2**62) + b"abc", id="huge-length"),
        pytest.param(b"\x11\x00\x00\x00\x00", id="truncated-fixed64"),
        pytest.param(b"\x15\x00\x00", id="truncated-fixed32"),
        pytest.param(b"\x0a\x02\xff\xfe", id="invalid-utf8"),
        pytest.param(b"\x0a\x02\xc3", id="truncated-utf8-sequence"),
        pytest.param(length_delimited(1, b"\xed\xa0\x80"), id="utf8-surrogate"),
        pytest.param(b"\x0b", id="wire-type-3"),
        pytest.param(b"\x0c", id="wire-type-4"),
        pytest.param(b"\x0e", id="wire-type-6"),
        pytest.param(b"\x0f", id="wire-type-7"),
        pytest.param(length_delimited(2, b"v") + b"\x1b", id="wire-type-3-after-a-field"),
    ],
)
def test_malformed_bytes_raise_wire_error(data):
    with pytest.raises(wire.WireError):
        wire.string_field(data, 1)


def test_invalid_utf8_in_another_field_is_not_read():
    data = length_delimited(2, b"\xff\xfe") + length_delimited(1, b"ok")
    assert wire.string_field(data, 1) == "ok"


def test_wire_error_is_a_value_error():
    assert issubclass(wire.WireError, ValueError)


def test_random_bytes_give_str_none_or_wire_error():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    chunks = st.one_of(
        st.binary(max_size=12),
        st.builds(varint, st.integers(min_value=0, max_value=2**70)),
        st.builds(length_delimited, st.integers(min_value=1, max_value=20), st.binary(max_size=12)),
    )

    @hypothesis.settings(max_examples=300, deadline=None, database=None)
    @hypothesis.given(
        st.one_of(st.binary(max_size=64), st.lists(chunks, max_size=6).map(b"".join)),
        st.integers(min_value=1, max_value=20),
    )
    def check(data, number):
        try:
            result = wire.string_field(data, number)
        except wire.WireError:
            return
        assert result is None or isinstance(result, str)

    check()


def test_serialised_requests_give_back_their_model_name():
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies

    @hypothesis.settings(max_examples=100, deadline=None, database=None)
    @hypothesis.given(st.text(), st.text(), st.binary(max_size=64))
    def check(model_name, version, raw):
        data = pb.ModelInferRequest(
            model_name=model_name, model_version=version, raw_input_contents=[raw]
        ).SerializeToString()
        assert wire.string_field(data, 1) == (model_name or None)

    check()


def test_hand_written_fields_match_protobuf():
    tensor = pb.ModelInferResponse.InferOutputTensor(name="ü" * 100, shape=[0, 1, 127, 128, 300, 2**40])
    written = (
        wire.string_field_bytes(1, tensor.name)
        + wire.string_field_bytes(2, "")
        + wire.packed_varints(3, list(tensor.shape))
    )
    assert written == tensor.SerializeToString()
    assert wire.packed_varints(3, ()) == b"" and wire.string_field_bytes(1, "") == b""
    assert wire.length_delimited(5, b"") == b"\x2a\x00"


@pytest.mark.parametrize("number", [1, 2, 5, 15, 16, 17, 300])
@pytest.mark.parametrize("length", [0, 1, 127, 128, 300])
def test_length_delimited_fields_of_every_size_match_the_helper(number, length):
    value = bytes(range(256)) * 2
    assert wire.length_delimited(number, value[:length]) == length_delimited(number, value[:length])
