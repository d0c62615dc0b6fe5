"""The table of model formats: how to recognise each and what it needs.

This module is plain data and imports no framework, so the front can validate
a load (format known, framework installed, files present) before it touches a
worker. The worker imports `Format.module` to load a model; each such module
exposes `load(path) -> model`, an object with:

    predict(inputs, parameters, requested_outputs) -> dict[str, array]
        inputs: dict[str, numpy.ndarray]; parameters: the request's parameters
        as plain values; requested_outputs: output names the request asked for
        (empty: the format's default outputs). responses.encode_response selects and
        orders what is returned.
    metadata() -> dict | None   {"inputs"/"outputs": [{name, datatype, shape}],
                                 "platform": str}, None when unknown
    handles_methods: bool       True when handle(method, request_bytes) exists
    close()                     called on unload (SIGTERM), best effort
"""

from __future__ import annotations

import dataclasses
import importlib
import os

KiB = 1024
MiB = 1024 * KiB


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
    # Its load may run on another thread than its calls (a pack's loader, workers/holding.py):
    # the framework's objects are not bound to the thread that made them. Not a custom model,
    # whose constructor may open what only that thread may use (a sqlite connection, say).
    loads_on_any_thread: bool = True
    # What a worker's first calls add to it, charged in its reported size until
    # it has served one: a spare rehearses the common call path, but not the
    # model's own first predict (docs/density.md). A pack has it in its base:
    # what its models' calls add after its last load.
    first_calls_bytes: int = 384 * KiB
    # What a worker of its own holds once it has imported the framework itself, which it does
    # where the fork servers do not preload it (WORKER_PRELOAD): predictModelSize adds it to the
    # floor, measured with the framework preloaded, so that it still covers modelSize.
    import_bytes: int = 0
    # A worker of its own puts the model's folder on sys.path (a custom model's helper modules
    # beside its model.py); a pack does not: see runtime/modelspec.py, ModelSpec.brings_modules.
    imports_from_its_folder: bool = False

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
# size_floor: the size modelSize reports (runtime/memory.py: USS plus the
# kernel's share) for a worker serving the format's bundled example
# (scripts/make-examples: iris, a few KiB on disk) after one inference, with
# the default WORKER_PRELOAD (the frameworks imported and warmed by the fork
# server, so only the pages a worker touches are its own), rounded up with
# some headroom. Each entry gives the sizes right after the load and after a
# call, 4 workers each; an idle spare measures 5.6 MiB (4.3 MiB USS) in the
# same runs. The first worker of onnx and pytorch measures more: it alone maps
# the library code it runs until a second worker runs it too. Measured on 2
# cores, Python 3.11, scikit-learn 1.9, xgboost 3.2, lightgbm 4.7,
# onnxruntime 1.32, torch 2.13 (CPU), with meshtest/harness.py. Without
# preloading, a worker pays the whole import instead (measured: 140 MiB for
# torch, 70 MiB for sklearn, xgboost or lightgbm, 25 MiB for onnxruntime, and
# 1.2-1.8 s per load): keep the frameworks you serve in WORKER_PRELOAD. Those
# figures are each format's import_bytes, which predictModelSize adds to the floor then.
# tests/test_formats.py checks that predictModelSize still covers modelSize.
FORMATS: tuple[Format, ...] = (
    # A custom model: model.py defining `class Model`. 8.3 MiB loaded, 8.4 MiB
    # after a call (the example's numpy weights); a worker of a fork server
    # that imported only numpy measures less (its page tables are smaller).
    Format(
        "python",
        "workers.formats.python",
        file_names=("model.py",),
        aliases=("custom", "python3", "mesh-python"),
        size_floor=10 * MiB,
        loads_on_any_thread=False,
        imports_from_its_folder=True,
    ),
    # 8.4-8.5 MiB loaded, 8.5 MiB after a call.
    Format(
        "sklearn",
        "workers.formats.sklearn",
        framework="sklearn",
        extra="sklearn",
        suffixes=(".joblib", ".pkl", ".pickle"),
        aliases=("scikit-learn", "sk-learn", "skl"),
        size_floor=12 * MiB,
        import_bytes=70 * MiB,
        batches_rows=True,
    ),
    # 8.0-8.3 MiB loaded, 8.1-8.4 MiB after a call.
    Format(
        "xgboost",
        "workers.formats.xgboost",
        framework="xgboost",
        extra="xgboost",
        suffixes=(".json", ".ubj"),
        aliases=("xgb",),
        size_floor=10 * MiB,
        import_bytes=70 * MiB,
        batches_rows=True,
    ),
    # 7.4 MiB loaded, 7.5 MiB after a call.
    Format(
        "lightgbm",
        "workers.formats.lightgbm",
        framework="lightgbm",
        extra="lightgbm",
        suffixes=(".txt",),
        aliases=("lgbm", "lgb"),
        size_floor=10 * MiB,
        import_bytes=70 * MiB,
        batches_rows=True,
    ),
    # 9.1 MiB loaded, 9.2 MiB after a call; the first worker 17.9 MiB, 8 MiB
    # of it library code.
    Format(
        "onnx",
        "workers.formats.onnx",
        framework="onnxruntime",
        extra="onnx",
        suffixes=(".onnx",),
        aliases=("onnxruntime", "onnxruntime_onnx"),
        size_floor=20 * MiB,
        import_bytes=25 * MiB,
    ),
    # 7.4-7.8 MiB loaded, 8.0 MiB after a call (its first forward() profiles
    # the graph); the first worker 11.1 MiB.
    Format(
        "pytorch",
        "workers.formats.pytorch",
        framework="torch",
        extra="pytorch",
        suffixes=(".pt",),
        aliases=("torch", "torchscript", "pytorch_libtorch"),
        size_floor=14 * MiB,
        import_bytes=140 * MiB,
        first_calls_bytes=768 * KiB,  # its first forward() profiles the graph
    ),
)


def by_name(name: str, formats: tuple[Format, ...] = FORMATS) -> Format | None:
    """The format called `name` (case-insensitive, aliases included), or None."""
    wanted = name.strip().lower()
    for fmt in formats:
        if wanted == fmt.name or wanted in fmt.aliases:
            return fmt
    return None


def worker_threads() -> int:
    """Threads a framework may run per call: WORKER_THREADS, inherited from the front, else 1.

    The front sends a worker that many calls at once and a pod runs many
    workers, so more threads per call would only fight over the same cores.
    """
    try:
        return max(1, int(os.environ.get("WORKER_THREADS", "1")))
    except ValueError:
        return 1  # the front refuses to start on a bad value; be lenient here


def pack_loads_at_idle_priority(fmt: Format, threads: int) -> bool:
    """Whether a pack loads models of `fmt` on its idle-priority thread (workers/holding.py), with
    WORKER_THREADS = `threads`: not where a thread pool a load starts would inherit that priority."""
    return fmt.loads_on_any_thread and threads == 1


def load(format_name: str, path: str, shared: bool = False):
    """Worker side: load the model at `path` with its format's module; `shared`: into a pack,
    which other models share (a custom model's folder then stays off sys.path)."""
    fmt = by_name(format_name)
    if fmt is None:
        raise ValueError(f"unknown model format {format_name!r}")
    module = importlib.import_module(fmt.module)
    return module.load(path, shared=shared) if fmt.imports_from_its_folder else module.load(path)
