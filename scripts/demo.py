#!/usr/bin/env python3
"""The first-run demo: a real mesh-runtime, driven the way model-mesh drives it.

1. writes the example models (scripts/make_examples.py) into a private
   ROOT_MODEL_DIR, skipping those whose framework is not installed;
2. starts `python -m runtime` on a free port with its own RUNTIME_DIR and
   polls runtimeStatus until READY;
3. loads every example with loadModel, calls each with a sample input
   (KServe V2 ModelInfer) and prints the answers;
4. prints the worker table: pid, model, size reported, USS measured, load ms;
5. unloads everything and prints the memory returned;
6. stops the runtime with SIGTERM and checks that no process is left.

All memory figures are USS read from outside with psutil. Exits non-zero if
a step fails or a process outlives the runtime.

usage: scripts/demo            (this file is its body, run with .venv/bin/python)
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import numpy as np
import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Run by path, Python looks for imports in scripts/ (make_examples.py) but not in the
# repository's top folder, which holds meshtest/.
sys.path.insert(0, REPO)

import make_examples  # noqa: E402  (scripts/make_examples.py)

from meshtest import harness  # noqa: E402  (the runtime as a child process)
from meshtest.harness import MiB, alive, mesh_headers  # noqa: E402
from protos import grpc_predict_v2_pb2 as v2  # noqa: E402
from protos import model_runtime_pb2 as mm  # noqa: E402

WARM = 1  # one spare is enough for loads one at a time, and keeps the table short
CONTENTS = {
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "INT64": "int64_contents",
    "INT32": "int32_contents",
    "BOOL": "bool_contents",
    "BYTES": "bytes_contents",
}


def say(section: str, text: str = "") -> None:
    print(f"{section:<9} {text}".rstrip(), flush=True)


def mib(size: float) -> str:
    return f"{size / MiB:.1f} MiB"


# -- the runtime as a child process -------------------------------------------------------


class DemoRuntime(harness.Runtime):
    """The tests' runtime (meshtest/harness.py: `python -m runtime` in private temp folders, with gRPC
    stubs), reporting what it finds instead of asserting: the demo prints it."""

    def __init__(self):
        super().__init__(preload_frameworks=True, WORKERS_WARM=str(WARM))

    def titled(self, words: str) -> list[psutil.Process]:
        return [p for p in alive(harness.tree(self.pid)) if words in _title(p)]

    def stop(self) -> tuple[int, float]:
        """SIGTERM and wait; -> (processes still alive 10 s later, seconds the stop took)."""
        if self.process is None:
            return 0, 0.0
        processes = harness.tree(self.pid) if self.process.poll() is None else []
        started = time.monotonic()
        self.terminate()
        took = time.monotonic() - started
        self.channel.close()
        self._log.close()
        deadline = time.monotonic() + 10
        while alive(processes) and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(alive(processes)), took


def _title(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def _uss(process: psutil.Process) -> int:
    try:
        return process.memory_full_info().uss
    except psutil.Error:
        return 0


# -- model-mesh's calls ---------------------------------------------------------------------


def load(rt: DemoRuntime, example: make_examples.Example) -> tuple[int, float]:
    """loadModel as model-mesh sends it; -> (size reported, milliseconds)."""
    request = mm.LoadModelRequest(
        modelId=example.name,
        modelPath=os.path.join(rt.models, example.name),
        modelKey=json.dumps({"model_type": {"name": example.format}}),
    )
    started = time.monotonic()
    size = rt.mesh.loadModel(request, timeout=60).sizeInBytes
    return size, (time.monotonic() - started) * 1000


def infer(rt: DemoRuntime, example: make_examples.Example) -> dict[str, np.ndarray]:
    sample = make_examples.SAMPLE
    request = v2.ModelInferRequest(model_name=example.name)
    tensor = request.inputs.add(name=make_examples.INPUT_NAME, datatype="FP32", shape=sample.shape)
    tensor.contents.fp32_contents.extend(sample.ravel().tolist())
    for name in example.outputs:
        request.outputs.add(name=name)
    response = rt.infer.ModelInfer(request, metadata=mesh_headers(example.name), timeout=30)
    return {
        out.name: np.array(getattr(out.contents, CONTENTS[out.datatype])).reshape(out.shape)
        for out in response.outputs
    }


def shown(array) -> str:
    """Numbers to two decimals, on one line."""
    array = np.asarray(array)
    if array.ndim == 0:
        return f"{array:.2f}" if array.dtype.kind == "f" else str(array)
    return "[" + ", ".join(shown(item) for item in array) + "]"


# -- the demo ------------------------------------------------------------------------------------


def write_examples(rt: DemoRuntime) -> list[make_examples.Example]:
    written = make_examples.make(rt.models, log=lambda line: say("examples", line))
    say("examples", f"wrote {', '.join(e.name for e in written)} into {rt.models}")
    return written


def load_all(rt: DemoRuntime, examples) -> dict[str, tuple[int, float]]:
    say("load", 'loadModel for each, modelKey {"model_type": {"name": FORMAT}}, as model-mesh sends it')
    loaded = {}
    for example in examples:
        loaded[example.name] = load(rt, example)
        size, ms = loaded[example.name]
        say("", f"  {example.name:<14} {example.format:<9} {mib(size):>9}  {ms:5.0f} ms")
    return loaded


def infer_all(rt: DemoRuntime, examples) -> None:
    say(
        "infer",
        f"ModelInfer, input {make_examples.INPUT_NAME!r} FP32 {shown(make_examples.SAMPLE)}"
        " (a setosa, a virginica)",
    )
    for example in examples:
        answers = "   ".join(f"{name} {shown(array)}" for name, array in infer(rt, example).items())
        say("", f"  {example.name:<14} {answers}")


def worker_table(rt: DemoRuntime, loaded: dict[str, tuple[int, float]]) -> int:
    """Prints the table; -> the workers' USS added up."""
    say("workers", f"{'pid':>7}  {'model':<14} {'size reported':>14} {'USS measured':>13} {'load ms':>8}")
    total = 0
    for model_id, (size, ms) in loaded.items():
        worker = next(iter(rt.titled(f"model={model_id}")), None)
        pid, uss = (worker.pid, _uss(worker)) if worker else (0, 0)
        total += uss
        say("", f"{pid:>7}  {model_id:<14} {mib(size):>14} {mib(uss):>13} {ms:>8.0f}")
    for spare in rt.titled("worker spare"):
        say("", f"{spare.pid:>7}  {'(warm spare)':<14} {'':>14} {mib(_uss(spare)):>13}")
    say("", "size reported: the worker's USS right after its load, the size model-mesh gets;")
    say("", "USS measured: now, after one inference (modelSize reports this)")
    return total


def unload_all(rt: DemoRuntime, loaded) -> None:
    workers = [w for model_id in loaded for w in rt.titled(f"model={model_id}")]
    started = time.monotonic()
    for model_id in loaded:
        rt.mesh.unloadModel(mm.UnloadModelRequest(modelId=model_id), timeout=60)
    gone = "every worker is gone" if not alive(workers) else f"{len(alive(workers))} workers still alive"
    say("unload", f"unloadModel for each: {time.monotonic() - started:.2f} s in all; {gone}")


def run(rt: DemoRuntime) -> None:
    examples = write_examples(rt)
    started = time.monotonic()
    status = rt.start().status
    say(
        "runtime",
        f"python -m runtime on port {rt.port}: READY after {time.monotonic() - started:.1f} s "
        f"(capacity {status.capacityInBytes / 2**30:.1f} GiB, {WARM} warm spare)",
    )
    before = rt.settled_uss(WARM)
    loaded = load_all(rt, examples)
    infer_all(rt, examples)
    workers_uss = worker_table(rt, loaded)
    with_models = rt.settled_uss(WARM)
    unload_all(rt, loaded)
    after = rt.settled_uss(WARM)
    print(
        f"memory returned: {mib(with_models - after)} (the runtime's processes: {mib(before)} before "
        f"loading, {mib(with_models)} with the models, whose workers hold {mib(workers_uss)}, "
        f"{mib(after)} after unloading)",
        flush=True,
    )


def main() -> int:
    rt = DemoRuntime()
    print("mesh-runtime demo: each model in its own worker process, sizes measured, memory back on unload\n")
    ok = False
    try:
        run(rt)
        ok = True
    except Exception as error:
        print(f"\ndemo failed: {type(error).__name__}: {error}", file=sys.stderr)
        if os.path.exists(rt.log_path):
            print(f"the runtime's log ends with:\n{rt.log()[-3000:]}", file=sys.stderr)
    finally:
        left, took = rt.stop()
        if left:
            say("stopped", f"SIGTERM: {left} processes still alive 10 s after the runtime exited")
        elif rt.process is not None:
            say(
                "stopped",
                f"SIGTERM: the runtime and all its processes exited in {took:.1f} s; no process left",
            )
        shutil.rmtree(rt.root, ignore_errors=True)
    return 0 if ok and not left else 1


if __name__ == "__main__":
    sys.exit(main())
