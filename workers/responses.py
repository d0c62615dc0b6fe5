"""KServe V2 responses, inside the worker: the model's outputs (numpy) -> ModelInferResponse bytes.

encode_response() writes the response field by field, raw when the request
was raw: building it through protobuf's Python objects cost more than the
rest of a small call's encoding. Anything wrong with what the model returned
raises BadModelOutput (INTERNAL); a requested output the model does not
produce is the request's fault (v2.InvalidInput, INVALID_ARGUMENT).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from protos import grpc_predict_v2_pb2 as pb
from protos import wire
from workers.v2 import DATATYPES, ELEMENT_LENGTH, RAW_OUTPUT_FIELD, InvalidInput, output_names

# InferTensorContents' field numbers by name, for the contents written by hand.
_CONTENTS_FIELD_NUMBERS = {field.name: field.number for field in pb.InferTensorContents.DESCRIPTOR.fields}

# Raw BYTES outputs: numpy interleaves lengths and bytes from this many elements on, where they
# average under _INTERLEAVE_BELOW_BYTES (_length_prefixed).
_INTERLEAVE_FROM = 64  # below, numpy's set-up costs more than the loop it saves
_INTERLEAVE_BELOW_BYTES = 256  # bigger ones are joined as they are

# numpy dtype -> datatype, for outputs (keyed by the dtype itself: dtype.str builds a string each time)
_DATATYPE_OF = {dtype: name for name, (dtype, _) in DATATYPES.items() if name not in ("BF16", "BYTES")}


class BadModelOutput(ValueError):
    """The model returned something V2 cannot carry."""


def encode_response(request: pb.ModelInferRequest, outputs: dict[str, Any], raw: bool) -> bytes:
    """The model's outputs as one serialised ModelInferResponse for `request`."""
    body, buffers = encode_response_parts(request, outputs, raw)
    return body + b"".join(wire.bytes_field_header(RAW_OUTPUT_FIELD, len(b)) + bytes(b) for b in buffers)


def encode_response_parts(
    request: pb.ModelInferRequest, outputs: dict[str, Any], raw: bool, requested: list[str] | None = None
) -> tuple[bytes, list]:
    """-> (the response without raw_output_contents, the raw output buffers).

    requested: the request's output names when the caller has read them already.

    The buffers view the output arrays (no copy) and travel as separate ZeroMQ
    frames; appending each as field RAW_OUTPUT_FIELD to the body gives the
    full response, which the front does without parsing it.
    """
    if not isinstance(outputs, dict):
        raise BadModelOutput(f"predict() returned {type(outputs).__name__}, expected a dict of arrays")
    if requested is None:
        requested = output_names(request)
    wanted = requested or list(outputs)
    # Plain loops rather than lists built to be looked at once: in Python 3.11 each comprehension
    # is a function made and called, and a small response's encoding is mostly such overheads.
    for name in wanted:
        if name not in outputs:
            raise InvalidInput(
                f"requested output {name!r} is not produced by the model "
                f"(outputs: {', '.join(map(str, outputs))})"
            )
    tensors = [(_output_name(name), *_output_tensor(name, outputs[name])) for name in wanted]
    for _, datatype, _ in tensors:
        if datatype == "FP16":  # FP16 exists only raw, and raw is all-or-nothing across a response
            raw = True
    # Written field by field (protos/grpc_predict_v2.proto): model_name 1, model_version 2,
    # id 3, outputs 5; in each output, name 1, datatype 2, shape 3, contents 5.
    fields = [
        wire.string_field_bytes(1, request.model_name),
        wire.string_field_bytes(2, request.model_version),
        wire.string_field_bytes(3, request.id),
    ]
    buffers = []
    for name, datatype, array in tensors:
        head = _tensor_head(name, datatype, array.shape)
        if raw:
            buffers.append(_to_raw(name, datatype, array))
            fields.append(wire.length_delimited(5, head))
        else:  # contents written even when empty, as protobuf does
            fields.append(
                wire.length_delimited(5, head + wire.length_delimited(5, _contents(name, datatype, array)))
            )
    return b"".join(fields), buffers


# (name, datatype, shape) -> an output tensor's first three fields: a model
# answers with the same few over and over. Emptied when full. Long names are
# not kept: a model that names its outputs after a client's inputs would keep
# whatever a client sent, up to HEADS_MAX of them.
_heads: dict[tuple[str, str, tuple[int, ...]], bytes] = {}
HEADS_MAX = 1024
HEAD_NAME_KEPT_MAX = 256  # characters


def _tensor_head(name: str, datatype: str, shape: tuple[int, ...]) -> bytes:
    """InferOutputTensor's name, datatype and shape, serialised."""
    key = (name, datatype, shape)
    head = _heads.get(key)
    if head is None:
        if len(_heads) >= HEADS_MAX:
            _heads.clear()
        try:
            written_name = wire.string_field_bytes(1, name)
        except UnicodeEncodeError as error:  # a lone surrogate
            raise BadModelOutput(
                f"output name {name!r} cannot be written in UTF-8 ({error.reason})"
            ) from None
        head = written_name + wire.string_field_bytes(2, datatype) + wire.packed_varints(3, shape)
        if len(name) <= HEAD_NAME_KEPT_MAX and len(shape) <= HEAD_NAME_KEPT_MAX:
            _heads[key] = head
    return head


def _output_name(name: Any) -> str:
    """An output's name: a str, or bytes holding UTF-8 (protobuf's message took those too)."""
    if isinstance(name, bytes):
        try:
            return name.decode()
        except UnicodeDecodeError:
            raise BadModelOutput(f"output name {name!r} is not UTF-8") from None
    if not isinstance(name, str):
        raise BadModelOutput(
            f"output name {name!r} is of type {type(name).__name__}; V2 names outputs with str"
        )
    return name


def _output_tensor(name: str, value: Any) -> tuple[str, np.ndarray]:
    array = np.asarray(value)
    dtype = array.dtype
    datatype = _DATATYPE_OF.get(dtype)
    if datatype is not None:
        return datatype, array
    if dtype.kind in "OSU":
        return "BYTES", array
    # Big-endian arrays are named by their little-endian twin; _to_raw converts.
    datatype = _DATATYPE_OF.get(dtype.newbyteorder("<"))
    if datatype is None:
        raise BadModelOutput(f"output {name!r} has dtype {dtype}, which V2 cannot carry")
    return datatype, array


def _bytes_elements_of(name: str, array: np.ndarray) -> list[bytes]:
    """A BYTES output's elements: bytes as they are, str encoded UTF-8.

    Anything else (a number, None, an object) is the model's error: sending
    its str() would hand the client text the model never produced.
    """
    elements = array.ravel().tolist()  # an object array's own objects; bytes_ and str_ as Python's
    if set(map(type, elements)) <= {bytes}:  # the usual case, checked without a loop in Python
        return elements
    for index, element in enumerate(elements):
        if isinstance(element, str):
            elements[index] = _utf8(name, array, index, element)
        elif not isinstance(element, bytes):
            raise BadModelOutput(
                f"output {name!r} holds {type(element).__name__} at index "
                f"{_position(array, index)}; an object output must hold bytes or str"
            )
    return elements


def _utf8(name: str, array: np.ndarray, index: int, text: str) -> bytes:
    try:
        return text.encode()
    except UnicodeEncodeError as error:  # a lone surrogate
        raise BadModelOutput(
            f"output {name!r} holds a str at index {_position(array, index)} "
            f"that UTF-8 cannot encode ({error.reason})"
        ) from None


def _position(array: np.ndarray, flat_index: int) -> str:
    """An element's index as the model would write it: (row, column) in a 2-D output."""
    if array.ndim <= 1:
        return str(flat_index)
    return str(tuple(int(i) for i in np.unravel_index(flat_index, array.shape)))


def _to_raw(name: str, datatype: str, array: np.ndarray) -> bytes | memoryview:
    if datatype == "BYTES":
        return _length_prefixed(_bytes_elements_of(name, array))
    flat = np.ascontiguousarray(array, dtype=DATATYPES[datatype][0]).reshape(-1)
    return flat.view(np.uint8).data  # memoryview(array): the stubs type ndarray as a Buffer only on 3.12+


def _length_prefixed(elements: list[bytes]) -> bytes:
    """Raw BYTES: each element's 4-byte little-endian length, then its bytes.

    An output may hold millions of elements, and a Python loop costs about a
    microsecond per element. Past a few dozen small ones, numpy interleaves the
    lengths with the joined bytes through a mask of where each length goes; that
    takes a few passes over the output, so bigger elements are joined as they
    are, between their lengths, with no loop of ours.
    """
    count = len(elements)
    if count < _INTERLEAVE_FROM:
        return b"".join([part for data in elements for part in (ELEMENT_LENGTH.pack(len(data)), data)])
    lengths = np.fromiter(map(len, elements), dtype=np.int64, count=count)
    if lengths.sum() >= count * _INTERLEAVE_BELOW_BYTES:
        parts: list[bytes] = [b""] * (2 * count)
        parts[0::2] = map(ELEMENT_LENGTH.pack, lengths.tolist())
        parts[1::2] = elements
        return b"".join(parts)
    data = b"".join(elements)
    steps = lengths + 4
    heads = np.cumsum(steps) - steps  # where each element's length goes
    is_length = np.zeros(len(data) + 4 * len(elements), dtype=bool)
    for byte in range(4):
        is_length[heads + byte] = True
    joined = np.empty(len(is_length), dtype=np.uint8)
    joined[is_length] = lengths.astype("<u4").view(np.uint8)
    joined[~is_length] = np.frombuffer(data, dtype=np.uint8)
    return joined.tobytes()


def _contents(name: str, datatype: str, array: np.ndarray) -> bytes:
    """A typed output's serialised InferTensorContents.

    By hand where the packed field is the values' own bytes: floats and
    doubles (little-endian), and integers that all lie in 0..127 (class
    labels, say: a varint of one byte each). The rest through protobuf,
    which writes varints in C.
    """
    dtype, field = DATATYPES[datatype]
    # Only FP16 and BF16 have no contents field: FP16 outputs go raw, and no output is BF16.
    assert field is not None, datatype
    number = _CONTENTS_FIELD_NUMBERS[field]
    if datatype in ("FP32", "FP64"):
        data = np.ascontiguousarray(array, dtype=dtype).tobytes()
        return wire.length_delimited(number, data) if data else b""
    if datatype == "BYTES":
        values = _bytes_elements_of(name, array)
    else:
        values = array.ravel().tolist()
        one_byte_each = _as_one_byte_varints(values)
        if one_byte_each is not None:
            return wire.length_delimited(number, one_byte_each) if values else b""
    contents = pb.InferTensorContents()
    getattr(contents, field).extend(values)
    return contents.SerializeToString()


def _as_one_byte_varints(values: list) -> bytes | None:
    """The values as bytes when each is an integer in 0..127 (its own varint), else None."""
    try:
        data = bytes(values)
    except (ValueError, TypeError):  # negative, over 255, or not an integer
        return None
    return data if not data or max(data) < 128 else None


def metadata_response(model_name: str, platform: str, metadata: dict | None) -> bytes:
    """A serialised ModelMetadataResponse from a model's metadata() dict (or none)."""
    metadata = metadata or {}
    response = pb.ModelMetadataResponse(
        name=model_name,
        versions=[str(v) for v in metadata.get("versions", [])],
        platform=str(metadata.get("platform", platform)),
    )
    for kind in ("inputs", "outputs"):
        for tensor in metadata.get(kind, []):
            getattr(response, kind).add(
                name=str(tensor["name"]),
                datatype=str(tensor["datatype"]),
                shape=[int(d) for d in tensor.get("shape", [])],
            )
    return response.SerializeToString()
