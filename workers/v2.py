"""KServe V2 requests -> numpy, inside the worker.

decode_request() turns a ModelInferRequest into `dict[name, numpy.ndarray]`;
raw_input_contents become arrays over the received bytes (numpy.frombuffer,
no copy). Anything wrong with the request raises InvalidInput
(INVALID_ARGUMENT). The way back, outputs to a ModelInferResponse, is
workers/responses.py; both share the DATATYPES table here.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from protos import grpc_predict_v2_pb2 as pb

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

# Refuse absurd shapes before allocating anything: 2**40 elements is 4 TiB of FP32. numpy before 2.0
# takes at most 32 dimensions; a dimension past MAX_ELEMENTS is absurd even beside a zero.
MAX_ELEMENTS = 1 << 40
MAX_DIMENSIONS = 32
ELEMENT_LENGTH = struct.Struct("<I")  # what precedes each raw BYTES element


# Integer datatypes protobuf carries in a wider field: their values are checked against their range.
_NARROW_INTEGERS = frozenset({"INT8", "INT16", "UINT8", "UINT16"})


class InvalidInput(ValueError):
    """The request does not fit the V2 rules or the model."""


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


def _datatype(tensor, datatype: str) -> tuple[np.dtype, str | None]:
    known = DATATYPES.get(datatype)
    if known is None:  # the name read only now: a upb field read costs as much as the lookup
        raise InvalidInput(
            f"input {tensor.name!r}: unknown datatype {datatype!r} (expected one of {', '.join(DATATYPES)})"
        )
    return known


def _shape(tensor) -> tuple[int, ...]:
    shape = tuple(listed(tensor.shape))
    if len(shape) > MAX_DIMENSIONS:
        raise InvalidInput(f"input {tensor.name!r}: {len(shape)} dimensions, more than {MAX_DIMENSIONS}")
    if shape and min(shape) < 0:
        raise InvalidInput(f"input {tensor.name!r}: shape {list(shape)} has a negative dimension")
    if shape and max(shape) > MAX_ELEMENTS:
        raise InvalidInput(
            f"input {tensor.name!r}: shape {list(shape)} has a dimension of more than {MAX_ELEMENTS}"
        )
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
    dtype, _ = _datatype(tensor, datatype)
    if tensor.HasField("contents") and tensor.contents.ByteSize():  # which? Triton refuses it too
        raise InvalidInput(f"input {tensor.name!r} has contents, and the request raw_input_contents")
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
    elif datatype == "BOOL" and array.view(np.uint8).max(initial=0) > 1:
        array = array.view(np.uint8) != 0  # a byte numpy would keep as it is: any but 0 is true
    return array


def _bytes_elements(name: str, data: bytes, count: int) -> np.ndarray:
    """Raw BYTES: each element is a 4-byte little-endian length, then the bytes.

    The loop is the whole cost of a request of many small elements (a client
    may send millions in one request), so it does one unpack, one slice and
    one store per element and nothing else.
    """
    data = bytes(data)  # a slice of bytes is bytes: no view to copy out per element
    size = len(data)
    unpack = ELEMENT_LENGTH.unpack_from
    # Every element takes at least its length's 4 bytes: a shape that names more cannot allocate more.
    elements: list[bytes] = [b""] * min(count, size // 4)
    offset = 0
    for index in range(len(elements)):
        if offset + 4 > size:
            if offset == size:  # the elements ended before the shape's count
                raise _bytes_count_error(name, count, f"{index}")
            raise InvalidInput(f"input {name!r}: raw BYTES element header cut short at byte {offset}")
        (length,) = unpack(data, offset)
        start = offset + 4
        offset = start + length
        if offset > size:
            raise InvalidInput(f"input {name!r}: raw BYTES element of {length} bytes runs past the end")
        elements[index] = data[start:offset]
    if offset < size:
        if len(elements) < count:
            raise InvalidInput(f"input {name!r}: raw BYTES element header cut short at byte {offset}")
        raise _bytes_count_error(name, count, f"more: {size - offset} bytes after {count} elements")
    if len(elements) < count:
        raise _bytes_count_error(name, count, f"{len(elements)}")
    array = np.empty(count, dtype=object)
    array[:] = elements
    return array


def _bytes_count_error(name: str, count: int, held: str) -> InvalidInput:
    return InvalidInput(f"input {name!r}: shape needs {count} BYTES elements, raw contents hold {held}")


def _from_contents(tensor, count: int) -> np.ndarray:
    datatype = tensor.datatype
    dtype, field = _datatype(tensor, datatype)
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
    if datatype not in _NARROW_INTEGERS:
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
