"""Reads one string field from serialised protobuf bytes without parsing the message.

The front routes inference by the request's field 1 (model_name / name) when
no mm-model-id header is present. Parsing a whole ModelInferRequest would
decode its tensors; walking the wire format to field 1 costs a few varints,
even for a 16 MiB request.
"""
from __future__ import annotations

_VARINT, _FIXED64, _LENGTH_DELIMITED, _FIXED32 = 0, 1, 2, 5


class WireError(ValueError):
    """Bytes that are not a protobuf message."""


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


def string_field(data: bytes, number: int) -> str | None:
    """The first top-level string field `number` in `data`, or None when it is absent."""
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            _, pos = _varint(data, pos)
        elif wire_type == _FIXED64:
            pos += 8
        elif wire_type == _FIXED32:
            pos += 4
        elif wire_type == _LENGTH_DELIMITED:
            length, pos = _varint(data, pos)
            if pos + length > end:
                raise WireError(f"field {field} runs past the end of the message")
            if field == number:
                try:
                    return data[pos:pos + length].decode()
                except UnicodeDecodeError:
                    raise WireError(f"field {field} is not UTF-8") from None
            pos += length
        else:
            raise WireError(f"unsupported wire type {wire_type}")
        if pos > end:
            raise WireError("message is truncated")
    return None
