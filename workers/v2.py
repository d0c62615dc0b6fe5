"""KServe V2 tensors <-> numpy, inside the worker.

decode_request() turns a ModelInferRequest into `dict[name, numpy.ndarray]`;
raw_input_contents become arrays over the received bytes (numpy.frombuffer,
no copy). encode_response() turns the model's outputs back into a
ModelInferResponse, raw when the request was raw, writing the bytes itself:
building the message through protobuf's Python objects cost more than the
rest of a small call's encoding. Anything wrong with the request raises
InvalidInput (INVALID_ARGUMENT); anything wrong with what the model returned
raises BadModelOutput (INTERNAL).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from protos import grpc_predict_v2_pb2 as pb
from protos import wire

# ModelInferRequest.raw_input_contents and ModelInferResponse.raw_output_contents
RAW_INPUT_FIELD = 7
RAW_OUTPUT_FIELD = 6

# datatype -> (numpy dtype, typed contents field or None when raw-only)
DATATYPES: dict[str, tuple[np.dtype, str | None]] = {
    "BOOL": (np.dtype(np.bool_), "bool_contents"),
    "UINT8": (np.dtype("<u1"), "uint_contents"),
    "UINT16": (np.dtype("<u2"), "uint_contents"),
    "UINT32": (np.dtype("<u4"), "uint_contents"),
    "UINT64": (np.dtype("<u8"), "uint64_contents"),
    "INT8": (np.dtype("<i1"), "int_contents"),
    "INT16": (np.dtype("<i2"), "int_contents"),
    "INT32": (np.dtype("<i4"), "int_contents"),
    "INT64": (np.dtype("<i8"), "int64_contents"),
    "FP16": (np.dtype("<f2"), None),
    "FP32": (np.dtype("<f4"), "fp32_contents"),
    "FP64": (np.dtype("<f8"), "fp64_contents"),
    # numpy has no bfloat16: BF16 inputs reach the model widened to float32.
    "BF16": (np.dtype("<u2"), None),
    "BYTES": (np.dtype(object), "bytes_contents"),
}

# Typed contents written by hand: datatype -> field number in InferTensorContents.
_PACKED_AS_BYTES = {"FP32": 6, "FP64": 7}

# numpy dtype -> datatype, for outputs (keyed by the dtype itself: dtype.str builds a string each time)
_DATATYPE_OF = {dtype: name for name, (dtype, _) in DATATYPES.items() if name not in ("BF16", "BYTES")}

# Refuse absurd shapes before allocating anything: 2**40 elements is 4 TiB of FP32.
MAX_ELEMENTS = 1 << 40


class InvalidInput(ValueError):
    """The request does not fit the V2 rules or the model."""


class BadModelOutput(ValueError):
    """The model returned something V2 cannot carry."""


def sample_requests() -> list[bytes]:
    """Small ModelInferRequests, with typed and with raw contents, for a worker to rehearse on."""
    typed = pb.ModelInferRequest(model_name="rehearsal")
    typed.inputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend([0.0] * 4)
    raw = pb.ModelInferRequest(model_name="rehearsal", raw_input_contents=[bytes(16)])
    raw.inputs.add(name="x", datatype="FP32", shape=[1, 4])
    return [typed.SerializeToString(), raw.SerializeToString()]


def decode_request(
    request: pb.ModelInferRequest, raw_inputs: list | None = None
) -> tuple[dict[str, np.ndarray], dict[str, Any], bool]:
    """-> (inputs by name, request parameters, whether the request used raw contents).

    raw_inputs: the raw_input_contents as buffers taken out of the request
    before parsing (protos.wire.split_bytes_field), so that arrays view the
    received bytes; None reads them from the parsed request.
    """
    raw = listed(request.raw_input_contents) if raw_inputs is None else raw_inputs
    tensors = listed(request.inputs)
    if raw and len(raw) != len(tensors):
        raise InvalidInput(f"raw_input_contents has {len(raw)} entries for {len(tensors)} inputs")
    inputs: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(tensors):
        name = tensor.name
        if name in inputs:
            raise InvalidInput(f"input {name!r} appears twice")
        shape = _shape(tensor)
        count = _element_count(name, shape)
        if raw:
            array = _from_raw(tensor, raw[index], count)
        else:
            array = _from_contents(tensor, count)
        inputs[name] = array.reshape(shape)
    parameters = request.parameters
    return inputs, parameters_of(parameters) if parameters else {}, bool(raw)


def listed(field) -> list:
    """A repeated protobuf field's items, as a list.

    A slice rather than iteration: upb's containers have no iterator of their
    own, so Python walks them by index until an IndexError, and raising and
    dropping that error costs more than the rest of reading a small field.
    """
    return field[:]


def output_names(request: pb.ModelInferRequest) -> list[str]:
    """The names in the request's `outputs` (empty: the model's every output)."""
    outputs = listed(request.outputs)
    return [output.name for output in outputs] if outputs else []


def parameters_of(parameters) -> dict[str, Any]:
    """A protobuf map<string, InferParameter> as plain Python values."""
    values = {}
    for name, parameter in parameters.items():
        choice = parameter.WhichOneof("parameter_choice")
        values[name] = getattr(parameter, choice) if choice else None
    return values


def _datatype(name: str, datatype: str) -> tuple[np.dtype, str | None]:
    try:
        return DATATYPES[datatype]
    except KeyError:
        raise InvalidInput(
            f"input {name!r}: unknown datatype {datatype!r} (expected one of {', '.join(DATATYPES)})"
        ) from None


def _shape(tensor) -> tuple[int, ...]:
    shape = tuple(listed(tensor.shape))
    if shape and min(shape) < 0:
        raise InvalidInput(f"input {tensor.name!r}: shape {list(shape)} has a negative dimension")
    return shape


def _element_count(name: str, shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim  # Python ints: no overflow, checked below
        if count > MAX_ELEMENTS:
            raise InvalidInput(f"input {name!r}: shape {list(shape)} has more than {MAX_ELEMENTS} elements")
    return count


def _from_raw(tensor, data: bytes, count: int) -> np.ndarray:
    datatype = tensor.datatype
    dtype, _ = _datatype(tensor.name, datatype)
    if datatype == "BYTES":
        return _bytes_elements(tensor.name, data, count)
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise InvalidInput(
            f"input {tensor.name!r}: shape {list(tensor.shape)} of {tensor.datatype} "
            f"needs {expected} bytes, raw_input_contents has {len(data)}"
        )
    array = np.frombuffer(data, dtype=dtype)
    if datatype == "BF16":
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return array


def _bytes_elements(name: str, data: bytes, count: int) -> np.ndarray:
    """Raw BYTES: each element is a 4-byte little-endian length, then the bytes."""
    elements = []
    offset = 0
    while offset < len(data):
        if offset + 4 > len(data):
            raise InvalidInput(f"input {name!r}: raw BYTES element header cut short at byte {offset}")
        (length,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if offset + length > len(data):
            raise InvalidInput(f"input {name!r}: raw BYTES element of {length} bytes runs past the end")
        elements.append(bytes(data[offset : offset + length]))
        offset += length
    if len(elements) != count:
        raise InvalidInput(
            f"input {name!r}: shape needs {count} BYTES elements, raw contents hold {len(elements)}"
        )
    array = np.empty(count, dtype=object)
    array[:] = elements
    return array


def _from_contents(tensor, count: int) -> np.ndarray:
    datatype = tensor.datatype
    dtype, field = _datatype(tensor.name, datatype)
    if field is None:
        raise InvalidInput(f"input {tensor.name!r}: {datatype} can only be sent in raw_input_contents")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InvalidInput(
            f"input {tensor.name!r}: shape {list(tensor.shape)} needs {count} values "
            f"in contents.{field}, got {len(values)}"
        )
    if datatype == "BYTES":
        array = np.empty(count, dtype=object)
        array[:] = listed(values)
        return array
    if dtype.itemsize >= 4 or dtype.kind not in "iu":
        # The field's own type, so every value fits. fromiter is four times as
        # fast as asarray, which probes protobuf's container as a sequence first.
        return np.fromiter(values, dtype, count)
    # Protobuf stores INT8/INT16 in int32 and UINT8/UINT16 in uint32: check the
    # range ourselves, since numpy's cast would silently wrap 300 into 44.
    wide = np.fromiter(values, np.int64, count)
    limits = np.iinfo(dtype)
    if count and (wide.min() < limits.min or wide.max() > limits.max):
        raise InvalidInput(
            f"input {tensor.name!r}: a value does not fit {tensor.datatype} ({limits.min}..{limits.max})"
        )
    return wide.astype(dtype)


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
    missing = [name for name in wanted if name not in outputs]
    if missing:
        raise InvalidInput(
            f"requested output {missing[0]!r} is not produced by the model "
            f"(outputs: {', '.join(map(str, outputs))})"
        )
    tensors = [(name, *_output_tensor(name, outputs[name])) for name in wanted]
    # FP16 exists only raw, and raw is all-or-nothing across a response.
    raw = raw or "FP16" in [datatype for _, datatype, _ in tensors]
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
# answers with the same few over and over. Emptied when full.
_heads: dict[tuple[str, str, tuple[int, ...]], bytes] = {}
HEADS_MAX = 1024


def _tensor_head(name: str, datatype: str, shape: tuple[int, ...]) -> bytes:
    """InferOutputTensor's name, datatype and shape, serialised."""
    key = (name, datatype, shape)
    head = _heads.get(key)
    if head is None:
        if len(_heads) >= HEADS_MAX:
            _heads.clear()
        head = _heads[key] = (
            wire.string_field_bytes(1, name)
            + wire.string_field_bytes(2, datatype)
            + wire.packed_varints(3, shape)
        )
    return head


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
    elements = []
    for index, element in enumerate(array.ravel()):
        if isinstance(element, bytes):  # numpy.bytes_ too
            elements.append(element)
        elif isinstance(element, str):  # numpy.str_ too
            elements.append(_utf8(name, array, index, element))
        else:
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
        parts = []
        for data in _bytes_elements_of(name, array):
            parts.append(struct.pack("<I", len(data)))
            parts.append(data)
        return b"".join(parts)
    flat = np.ascontiguousarray(array, dtype=DATATYPES[datatype][0]).reshape(-1)
    return flat.view(np.uint8).data  # memoryview(array): the stubs type ndarray as a Buffer only on 3.12+


def _contents(name: str, datatype: str, array: np.ndarray) -> bytes:
    """A typed output's serialised InferTensorContents.

    Floats by hand: a packed repeated float or double is the values' own
    little-endian bytes. The rest through protobuf, which writes varints in C.
    """
    dtype, field = DATATYPES[datatype]
    if datatype in _PACKED_AS_BYTES:
        data = np.ascontiguousarray(array, dtype=dtype).tobytes()
        return wire.length_delimited(_PACKED_AS_BYTES[datatype], data) if data else b""
    # Only FP16 and BF16 have no contents field: FP16 outputs go raw, and no output is BF16.
    assert field is not None, datatype
    contents = pb.InferTensorContents()
    values = getattr(contents, field)
    if datatype == "BYTES":
        values.extend(_bytes_elements_of(name, array))
    else:
        values.extend(array.ravel().tolist())
    return contents.SerializeToString()


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
