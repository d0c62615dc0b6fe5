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
    module: str  # worker-side module with load(path)
    framework: str | None = None  # top-level module that must be importable
    extra: str | None = None  # pip extra that installs the framework
    file_names: tuple[str, ...] = ()  # exact names that identify the format
    suffixes: tuple[str, ...] = ()  # file endings that identify the format
    aliases: tuple[str, ...] = ()
    # The least a loaded model of this format costs, whatever its files weigh:
    # predictModelSize never answers less.
    size_floor: int = 8 * MiB
    # predict() answers each row of its input on its own, so calls that
    # queued up together may share one predict (workers/batching.py).
    batches_rows: bool = False

    def matches(self, file_name: str) -> bool:
        return file_name in self.file_names or file_name.endswith(self.suffixes or ("\0",))


# Detection order, when the request names no format and the files must tell:
# the order of DESIGN.md, python, sklearn, xgboost, lightgbm, onnx, pytorch; the
# first format with a matching file in modelPath wins. So a folder holding
# model.py is a custom model whatever else it holds (its code may read those
# files). .json (xgboost) and .txt (lightgbm) are the least specific endings
# and win over .onnx and .pt by this order alone: name the format in modelKey
# (model-mesh always does) when a folder mixes them.
#
# size_floor of a framework format: the USS of a worker serving that format's
# bundled example (scripts/make-examples: iris, a few KiB on disk) after one
# inference, read with modelSize, with the default WORKER_PRELOAD (the
# frameworks imported by the fork server, so only the pages a worker touches
# are its own), rounded up with some headroom. Each entry gives the worker's
# USS right after the load and after a call, and what the framework adds to
# an idle spare (4.7-4.9 MiB in the same runs). Measured on 2 cores, Python
# 3.11, scikit-learn 1.9, xgboost 3.2, lightgbm 4.7, onnxruntime 1.32, torch
# 2.13 (CPU), with tests/harness.py and psutil from outside. Without
# preloading, a worker pays the whole import instead (measured: 140 MiB for
# torch, 70 MiB for sklearn, xgboost or lightgbm, 25 MiB for onnxruntime, and
# 1.2-1.8 s per load): keep the frameworks you serve in WORKER_PRELOAD.
# tests/test_formats.py checks that predictModelSize still covers modelSize.
FORMATS: tuple[Format, ...] = (
    # A custom model: model.py defining `class Model`. Floor: a worker that
    # imported only numpy measures 4-6 MiB USS once loaded (scripts/bench).
    Format(
        "python",
        "workers.formats.python",
        file_names=("model.py",),
        aliases=("custom", "python3", "mesh-python"),
    ),
    # 13.8-14.1 MiB loaded, 15.9-16.3 MiB after a call: sklearn adds 9-11.5 MiB.
    # 18.0 and 19.7 MiB when the fork server preloads only numpy and sklearn
    # (the sklearn extra alone).
    Format(
        "sklearn",
        "workers.formats.sklearn",
        framework="sklearn",
        extra="sklearn",
        suffixes=(".joblib", ".pkl", ".pickle"),
        aliases=("scikit-learn", "sk-learn", "skl"),
        size_floor=24 * MiB,
        batches_rows=True,
    ),
    # 7.4-7.5 MiB loaded, 7.8 MiB after a call: xgboost adds 2.6-3.1 MiB.
    Format(
        "xgboost",
        "workers.formats.xgboost",
        framework="xgboost",
        extra="xgboost",
        suffixes=(".json", ".ubj"),
        aliases=("xgb",),
        size_floor=10 * MiB,
        batches_rows=True,
    ),
    # 6.0-6.2 MiB loaded, 6.5 MiB after a call: lightgbm adds 1.2-1.8 MiB.
    Format(
        "lightgbm",
        "workers.formats.lightgbm",
        framework="lightgbm",
        extra="lightgbm",
        suffixes=(".txt",),
        aliases=("lgbm", "lgb"),
        size_floor=8 * MiB,
        batches_rows=True,
    ),
    # 15.5-15.7 MiB loaded, 16.6-16.7 MiB after a call: onnxruntime adds
    # 10.7-12 MiB, 8 MiB of it library code that only this worker has mapped.
    Format(
        "onnx",
        "workers.formats.onnx",
        framework="onnxruntime",
        extra="onnx",
        suffixes=(".onnx",),
        aliases=("onnxruntime", "onnxruntime_onnx"),
        size_floor=20 * MiB,
    ),
    # 7.6-7.7 MiB loaded, 15.2 MiB after a call: torch adds 2.8-10.5 MiB (the
    # first forward() sets up its CPU kernels and allocator).
    Format(
        "pytorch",
        "workers.formats.pytorch",
        framework="torch",
        extra="pytorch",
        suffixes=(".pt",),
        aliases=("torch", "torchscript", "pytorch_libtorch"),
        size_floor=18 * MiB,
    ),
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
