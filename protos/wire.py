"""Protobuf wire format by hand, where parsing a whole message would copy tensors.

- string_field(): the front routes inference by the request's field 1
  (model_name / name) when no mm-model-id header is present. Skipping a
  length-delimited field costs the same whatever its size, so the walk's
  cost is its number of fields, and the front bounds that number: a body
  of millions of tiny fields must not hold the event loop.
- split_bytes_field(): the worker takes raw_input_contents out of a request
  as views over the received ZeroMQ frame, so numpy arrays are built over
  those very bytes; protobuf parses only the small rest.
- bytes_field_header(): a repeated bytes field may be appended to a
  serialised message; the front joins the worker's raw output frames onto
  the response that way, without parsing it.
- length_delimited() and friends: the worker writes a ModelInferResponse
  field by field, where building it through protobuf's Python objects would
  cost more than the rest of a small call (workers/responses.py).

Shared by the front and the workers, like the generated code beside it.
"""

from __future__ import annotations

from collections.abc import Sequence

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5

# No V2 message has anywhere near this many top-level fields (one to three
# per tensor); a body that does is refused rather than walked to its end.
MAX_FIELDS = 100_000


class WireError(ValueError):
    """Bytes that are not a protobuf message."""


class TooManyFields(WireError):
    """A walk gave up after its bound on the number of fields."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(data, max_fields: int = MAX_FIELDS):
    """Yields (field number, wire type, start of the field, start of its value, end of its value).

    For a length-delimited field the value is its bytes, without the length;
    for the others only the end matters. Raises WireError on bytes that are
    not a message, and on the field after the first `max_fields`.
    """
    pos, end, count = 0, len(data), 0
    while pos < end:
        count += 1
        if count > max_fields:
            raise TooManyFields(f"more than {max_fields} top-level fields")
        field_start = pos
        key, pos = _varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value_end = _varint(data, pos)[1]
        elif wire_type == _FIXED64:
            value_end = pos + 8
        elif wire_type == _FIXED32:
            value_end = pos + 4
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _varint(data, pos)
            value_end = pos + length
        else:
            raise WireError(f"unsupported wire type {wire_type} (field {field})")
        if value_end > end:
            raise WireError(f"field {field} runs past the end of the message")
        yield field, wire_type, field_start, pos, value_end
        pos = value_end


def split_bytes_field(data, number: int) -> tuple[bytes, list[memoryview]]:
    """Takes every top-level field `number` out of `data`: (the rest, the values as views)."""
    view = memoryview(data)
    kept, values, run_start = [], [], 0
    for field, wire_type, field_start, value_start, value_end in _fields(view):
        if field == number and wire_type == _LENGTH_DELIMITED:
            kept.append(view[run_start:field_start])
            values.append(view[value_start:value_end])
            run_start = value_end
    kept.append(view[run_start:])
    return b"".join(kept), values


def bytes_field_header(number: int, length: int) -> bytes:
    """The key and length that precede a length-delimited field's value."""
    return _encode_varint((number << 3) | _LENGTH_DELIMITED) + _encode_varint(length)


# Key and length of a field numbered under 16 whose value is under 128 bytes (a byte each: most
# fields of a small response), by number and length: looked up, they cost half what bytes() of
# the two numbers does, and a small response writes several (callgrind).
_SMALL_FIELD_HEADERS = [
    [bytes(((number << 3) | _LENGTH_DELIMITED, length)) for length in range(128)] for number in range(16)
]


def length_delimited(number: int, value: bytes) -> bytes:
    """A whole length-delimited field (bytes, string, sub-message, packed repeated): key, length, value."""
    length = len(value)
    if number < 16 and length < 128:
        return _SMALL_FIELD_HEADERS[number][length] + value
    return bytes_field_header(number, length) + value


def string_field_bytes(number: int, text: str) -> bytes:
    """A proto3 string field as protobuf writes it: nothing at all when empty."""
    return length_delimited(number, text.encode()) if text else b""


def packed_varints(number: int, values: Sequence[int]) -> bytes:
    """A packed repeated field of non-negative integers (a tensor's shape); nothing when empty."""
    if not values:
        return b""
    if max(values) < 128:  # each value one byte, as in nearly every shape
        return length_delimited(number, bytes(values))
    return length_delimited(number, b"".join(map(_encode_varint, values)))


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def string_field(data, number: int, max_fields: int = MAX_FIELDS) -> str | None:
    """The first top-level string field `number` in `data`, or None when it is absent.

    Raises TooManyFields when it is not among the first `max_fields` fields.
    """
    for field, wire_type, _, value_start, value_end in _fields(data, max_fields):
        if field == number and wire_type == _LENGTH_DELIMITED:
            try:
                return bytes(data[value_start:value_end]).decode()
            except UnicodeDecodeError:
                raise WireError(f"field {field} is not UTF-8") from None
    return None
