"""What the framework formats share: finding the model file, taking the one input, describing tensors.

Imports no framework: the fork server imports every format module up front,
and the frameworks are imported by each module's load() only.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from workers import formats, v2


def model_file(path: str, format_name: str) -> str:
    """The model's file: `path` itself, or the one file of the format in the folder `path`.

    Several candidates are fine when exactly one is called model.<ending>:
    MLServer and KServe layouts keep e.g. model-settings.json beside model.json.
    """
    if not os.path.isdir(path):
        return path
    fmt = formats.by_name(format_name)
    if fmt is None:
        raise ValueError(f"unknown model format {format_name!r}")
    found = sorted(
        name for name in os.listdir(path) if fmt.matches(name) and os.path.isfile(os.path.join(path, name))
    )
    if len(found) > 1:
        named_model = [name for name in found if name.split(".", 1)[0] == "model"]
        found = named_model if len(named_model) == 1 else found
    if len(found) != 1:
        endings = ", ".join(fmt.file_names + fmt.suffixes)
        holds = f"{len(found)} such files ({', '.join(found)})" if found else "no such file"
        raise ValueError(f"{path} must hold exactly one {fmt.name} model file ({endings}); it holds {holds}")
    return os.path.join(path, found[0])


def first_input(inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The request's first input tensor: these formats take one, whatever its name."""
    for array in inputs.values():
        return array
    raise v2.InvalidInput("the request has no input tensor; this model takes one")


def feature_rows(array: np.ndarray, n_features: int | None) -> np.ndarray:
    """`array` checked to be a batch of rows with the model's feature count.

    The frameworks would say the same in their own words, as an exception the
    worker could only answer with INTERNAL; this is the client's mistake.
    """
    if array.ndim != 2:
        wanted = f"[rows, {n_features}]" if n_features else "[rows, features]"
        raise v2.InvalidInput(f"input has shape {list(array.shape)}; this model takes a 2-D batch {wanted}")
    if n_features and array.shape[1] != n_features:
        raise v2.InvalidInput(f"input has {array.shape[1]} features per row; this model takes {n_features}")
    if array.dtype.kind not in "biuf":
        raise v2.InvalidInput(f"input is {array.dtype}; this model takes numbers")
    return array


def as_text(array: np.ndarray) -> np.ndarray:
    """BYTES elements (bytes) as str, which text-taking frameworks expect."""
    try:
        decoded = [item.decode() if isinstance(item, bytes) else item for item in array.ravel()]
    except UnicodeDecodeError as error:
        raise v2.InvalidInput(f"a BYTES element is not UTF-8 text: {error}") from None
    result = np.empty(array.size, dtype=object)
    result[:] = decoded
    return result.reshape(array.shape)


def datatype_of(dtype: np.dtype) -> str:
    """The V2 datatype name of a numpy dtype ("BYTES" for text and objects)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return "BYTES"
    for name, (candidate, _) in v2.DATATYPES.items():
        if name != "BF16" and candidate == dtype.newbyteorder("<"):
            return name
    return ""  # no V2 equivalent (complex numbers, dates): unknown to the client


def check_requested(requested: list[str], outputs: list[str]) -> None:
    """Refuses a requested output not in `outputs`, naming them: a format that computes only the
    requested ones cannot leave that to responses.encode_response, which knows only those."""
    for name in requested:
        if name not in outputs:
            raise v2.InvalidInput(
                f"requested output {name!r} is not produced by the model (outputs: {', '.join(outputs)})"
            )


def tensor(name: str, datatype: str, shape: Any) -> dict:
    """One entry of metadata()'s inputs or outputs; -1 marks a dimension that varies."""
    return {"name": name, "datatype": datatype, "shape": [int(d) for d in shape]}
