"""The table of model formats: how to recognise each and what it needs.

This module is plain data and imports no framework, so the front can validate
a load (format known, framework installed, files present) before it touches a
worker. The worker imports `Format.module` to load a model; each such module
exposes `load(path) -> model`, an object with:

    predict(inputs, parameters, requested_outputs) -> dict[str, array]
        inputs: dict[str, numpy.ndarray]; parameters: the request's parameters
        as plain values; requested_outputs: output names the request asked for
        (empty: the format's default outputs). v2.encode_response selects and
        orders what is returned.
    metadata() -> dict | None   {"inputs"/"outputs": [{name, datatype, shape}],
                                 "platform": str}, None when unknown
    handles_methods: bool       True when handle(method, request_bytes) exists
    close()                     called on unload (SIGTERM), best effort
"""
from __future__ import annotations

import dataclasses
import importlib

MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Format:
    name: str
    module: str                      # worker-side module with load(path)
    framework: str | None = None     # top-level module that must be importable
    extra: str | None = None         # pip extra that installs the framework
    file_names: tuple[str, ...] = ()  # exact names that identify the format
    suffixes: tuple[str, ...] = ()    # file endings that identify the format
    aliases: tuple[str, ...] = ()
    # The least a loaded model of this format costs, whatever its files weigh:
    # predictModelSize never answers less.
    size_floor: int = 8 * MiB

    def matches(self, file_name: str) -> bool:
        return file_name in self.file_names or file_name.endswith(self.suffixes or ("\0",))


FORMATS: tuple[Format, ...] = (
    # A custom model: model.py defining `class Model`. Floor: a worker that
    # imported only numpy measures 4-6 MiB USS once loaded (scripts/bench).
    Format("python", "workers.formats.python", file_names=("model.py",),
           aliases=("custom", "python3", "mesh-python")),
)


def by_name(name: str, formats: tuple[Format, ...] = FORMATS) -> Format | None:
    """The format called `name` (case-insensitive, aliases included), or None."""
    wanted = name.strip().lower()
    for fmt in formats:
        if wanted == fmt.name or wanted in fmt.aliases:
            return fmt
    return None


def load(format_name: str, path: str):
    """Worker side: load the model at `path` with its format's module."""
    fmt = by_name(format_name)
    if fmt is None:
        raise ValueError(f"unknown model format {format_name!r}")
    return importlib.import_module(fmt.module).load(path)
