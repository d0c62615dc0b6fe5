"""scripts/bench --packs, first part: what a pack recycle costs the unload and the pack's other models.

One runtime with packs of the product's size (MODELS_PER_WORKER), python
models only (WORKER_PRELOAD=numpy). A pack is filled with the python iris
model, its last place taken by a model that keeps memory after it is dropped
(it parks a buffer in numpy), so that unloading it leaves the pack short of
what the model was charged and the runtime must recycle the pack before the
unload returns. Each round:

- a caller thread sends sequential ModelInfer calls to random other models of
  that pack, each with a DEADLINE_S deadline, all through the round;
- for BASELINE_S nothing else happens: those calls are the pack's calls
  without a recycle;
- the keeping model is unloaded (the recycle: a fresh pack loads the others,
  their calls move to it, the old pack is killed and reaped); the calls sent
  while that unload ran are the calls during a recycle;
- a new keeping model is loaded into the place it left, for the next round.

Then every model is unloaded, two at a time as model-mesh does, for the
unloads that need no recycle. Reported: unloadModel p50/p99 with and without
a recycle, ModelInfer p50/p99 of the pack's other models without and during
a recycle, and every call that did not answer OK.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time

import grpc

from bench.common import percentile, progress
from bench.scale import timed_ms, write_copies
from bench.scale_servers import iris_request, model_id
from meshtest import harness
from runtime.admin import cli as admin
from runtime.settings import Settings

ROUNDS = 20
BASELINE_S = 1.0
DEADLINE_S = 10.0

# Keeps 2 MiB after it is dropped (below MODEL_PACK_MAX_BYTES, so it stays packed):
# the pack cannot shrink by what it was charged.
KEEPING_MODEL = """
    import numpy as np

    class Model:
        def __init__(self, path):
            kept = getattr(np, "_kept_by_bench", [])
            kept.append(np.ones(2 * 1024 * 1024, dtype=np.uint8))
            np._kept_by_bench = kept

        def predict(self, inputs):
            return dict(inputs)
"""


class Calls:
    """Sequential calls to random models of `indexes` on a thread: (started, ms, status) each."""

    def __init__(self, rt: harness.Runtime, indexes: list[int]):
        self.rt, self.indexes = rt, indexes
        self.done: list[tuple[float, float, grpc.StatusCode]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> Calls:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(DEADLINE_S + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            index = random.choice(self.indexes)
            started = time.monotonic()
            try:
                self.rt.infer.ModelInfer(
                    iris_request(index), metadata=harness.mesh_headers(model_id(index)), timeout=DEADLINE_S
                )
                code = grpc.StatusCode.OK
            except grpc.RpcError as error:
                code = error.code()
            self.done.append((started, (time.monotonic() - started) * 1000, code))

    def between(self, start: float, end: float) -> list[tuple[float, float, grpc.StatusCode]]:
        """The calls sent from `start` to `end`."""
        return [call for call in self.done if start <= call[0] < end]


def pack_of(rt: harness.Runtime, name: str) -> tuple[int, list[str]]:
    """The pid of the pack that holds model `name`, and the models in it, from the admin socket."""
    rows = admin.ask(rt.env["RUNTIME_DIR"], "workers")
    assert isinstance(rows, list), rows
    for row in rows:
        if row["role"] == "pack" and name in [m["model"] for m in row["models"]]:
            return row["pid"], [m["model"] for m in row["models"]]
    raise AssertionError(f"{name} is in no pack: {rows}")


def one_round(rt: harness.Runtime, keeping: str) -> dict:
    """Unloads the keeping model under calls to its pack's other models."""
    old_pid, members = pack_of(rt, keeping)
    others = [int(m[1:]) for m in members if m != keeping]
    with Calls(rt, others) as calls:
        time.sleep(BASELINE_S)
        started = time.monotonic()
        rt.unload(keeping)
        ended = time.monotonic()
        time.sleep(0.2)
    new_pid, _ = pack_of(rt, model_id(others[0]))
    return {
        "unload_ms": (ended - started) * 1000,
        "recycled": new_pid != old_pid,
        "baseline": calls.between(0, started),
        "during": calls.between(started, ended),
        "all": calls.done,
    }


def run(rounds: int = ROUNDS) -> dict:
    per_pack = Settings.from_env({}).models_per_worker
    rt = harness.Runtime(WORKERS_WARM="2", MODELS_PER_WORKER=str(per_pack), LOG_LEVEL="warning")
    try:
        models = write_copies("python", rt.models, per_pack - 1)  # under its ROOT_MODEL_DIR
        rt.start()
        progress(f"recycle: a pack of {per_pack} python models, {rounds} recycles")
        for index, path in enumerate(models):
            rt.load(model_id(index), path)
            rt.infer.ModelInfer(iris_request(index), metadata=harness.mesh_headers(model_id(index)))
        keeping_path = rt.model_dir("keeping", KEEPING_MODEL)
        unloads, recycles, baseline, during, failed = [], 0, [], [], []
        keeping = "keeping-0"
        rt.load(keeping, keeping_path)
        for round_number in range(rounds):
            result = one_round(rt, keeping)
            unloads.append(result["unload_ms"])
            recycles += result["recycled"]
            baseline += [ms for _, ms, code in result["baseline"] if code is grpc.StatusCode.OK]
            during += [ms for _, ms, code in result["during"] if code is grpc.StatusCode.OK]
            failed += [code.name for _, _, code in result["all"] if code is not grpc.StatusCode.OK]
            keeping = f"keeping-{round_number + 1}"
            rt.load(keeping, keeping_path)
        rt.unload(keeping)
        plain = unload_all(rt, len(models))
        return {
            "models_per_worker": per_pack,
            "rounds": rounds,
            "recycles": recycles,
            "recycling_unload_p50_ms": percentile(unloads, 50),
            "recycling_unload_p99_ms": percentile(unloads, 99),
            "plain_unload_p50_ms": percentile(plain, 50),
            "plain_unload_p99_ms": percentile(plain, 99),
            "calls_without": len(baseline),
            "calls_during": len(during),
            "infer_without_p50_ms": percentile(baseline, 50),
            "infer_without_p99_ms": percentile(baseline, 99),
            "infer_during_p50_ms": percentile(during, 50) if during else None,
            "infer_during_p99_ms": percentile(during, 99) if during else None,
            "failed_calls": failed,
        }
    finally:
        rt.stop()


def unload_all(rt: harness.Runtime, count: int) -> list[float]:
    """Unloads models 0..count-1 two at a time; each unload's ms."""
    with concurrent.futures.ThreadPoolExecutor(2) as unloaders:
        return list(unloaders.map(lambda i: timed_ms(rt.unload, model_id(i)), range(count)))


def describe(r: dict) -> list[str]:
    """The report's lines."""
    during = "-" if r["infer_during_p99_ms"] is None else f"{r['infer_during_p99_ms']:.2f}"
    ratio = (
        "-"
        if r["infer_during_p99_ms"] is None
        else f"{r['infer_during_p99_ms'] / r['infer_without_p99_ms']:.2f}"
    )
    return [
        f"recycle: {r['recycles']} of {r['rounds']} unloads recycled a pack of {r['models_per_worker']}",
        f"  unloadModel with a recycle p50 / p99: {r['recycling_unload_p50_ms']:.1f} / "
        f"{r['recycling_unload_p99_ms']:.1f} ms (target p99 <= 100)",
        f"  unloadModel without one p50 / p99: {r['plain_unload_p50_ms']:.1f} / "
        f"{r['plain_unload_p99_ms']:.1f} ms",
        f"  ModelInfer to the pack's other models without a recycle p50 / p99: "
        f"{r['infer_without_p50_ms']:.2f} / {r['infer_without_p99_ms']:.2f} ms ({r['calls_without']} calls)",
        f"  ... during a recycle p99: {during} ms ({r['calls_during']} calls), "
        f"{ratio}x without (target <= 2)",
        f"  calls that did not answer OK: {len(r['failed_calls'])} {sorted(set(r['failed_calls']))}",
    ]
