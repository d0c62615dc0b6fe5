"""scripts/bench --packs, second part: churn near capacity, and whether the sizes stay honest.

One runtime with the product's settings (packs of MODELS_PER_WORKER, every
installed framework preloaded) in a memory cgroup of its own, and a driver
that plays model-mesh with a pod whose capacityInBytes is CAPACITY_BYTES:
POOL python iris models, each in its own folder; the pod is first filled up
to its capacity by predictModelSize, then OPS operations drawn at random
(seeded), one after another:

- ModelInfer to a random loaded model (INFER_SHARE of them);
- loadModel of a model not loaded (LOAD_SHARE), after unloading the least
  recently used models until its predicted size fits beside the sizes of
  those loaded, as model-mesh's cache does;
- unloadModel of a random loaded model (the rest).

After every CHECKPOINT operations, with the pool settled: the sum of the sizes
loadModel answered for the models loaded now (what model-mesh packs the pod
by) over what the cgroup grew by since the start, alone and with what
capacityInBytes holds back for packs not yet full, and how the cgroup's page
cache moved meanwhile (file pages the kernel can take back at any time). Target: between 1.00 and
1.15 at every checkpoint, never below (below, model-mesh over-commits).
"""

from __future__ import annotations

import collections
import json
import random
import shutil
import tempfile

import grpc

from bench.common import MiB, progress
from bench.scale import write_copies
from bench.scale_servers import MeshRuntime, model_id
from meshtest import cgroup
from meshtest.harness import alive
from protos import model_runtime_pb2 as mm
from runtime.settings import Settings

POOL = 600
OPS = 10_000
CHECKPOINT = 1_000
CAPACITY_BYTES = 96 * MiB
INFER_SHARE, LOAD_SHARE = 0.5, 0.3
PYTHON_KEY = json.dumps({"model_type": {"name": "python"}})
SLOW_LOAD_LOGGED = "runs long: its"  # the front's warning as a pack's other models move out


class Pod:
    """model-mesh's view of the pod: which models are loaded, their sizes, least recently used first."""

    def __init__(self, server: MeshRuntime, capacity: int):
        self.server, self.capacity = server, capacity
        self.sizes: collections.OrderedDict[int, int] = collections.OrderedDict()
        self.counts: collections.Counter[str] = collections.Counter()

    def predicted(self, index: int) -> int:
        request = mm.PredictModelSizeRequest(
            modelId=model_id(index), modelPath=self.server.models[index], modelKey=PYTHON_KEY
        )
        return self.server.rt.mesh.predictModelSize(request, timeout=10).sizeInBytes

    def fits(self, index: int) -> bool:
        return sum(self.sizes.values()) + self.predicted(index) <= self.capacity

    def load(self, index: int) -> None:
        while self.sizes and not self.fits(index):
            self.unload(next(iter(self.sizes)), "evictions")
        self.sizes[index] = self.server.load(index)
        self.counts["loads"] += 1

    def unload(self, index: int, kind: str = "unloads") -> None:
        self.server.unload(index)
        del self.sizes[index]
        self.counts[kind] += 1

    def infer(self, index: int) -> None:
        code = self.server.try_infer(index, 10.0)
        self.counts["infers" if code is grpc.StatusCode.OK else f"infer {code.name}"] += 1
        self.sizes.move_to_end(index)


def one_op(pod: Pod, rng: random.Random) -> None:
    draw = rng.random()
    if pod.sizes and draw < INFER_SHARE:
        pod.infer(rng.choice(list(pod.sizes)))
    elif draw < INFER_SHARE + LOAD_SHARE or not pod.sizes:
        pod.load(rng.choice([i for i in range(POOL) if i not in pod.sizes]))
    else:
        pod.unload(rng.choice(list(pod.sizes)))


def checkpoint(pod: Pod, meter: cgroup.Meter, base: tuple[int, int | None], held: int, ops: int) -> dict:
    """The sizes against the cgroup's growth since `base` (usage, page cache) now, with the pool settled."""
    pod.server.wait_settled()
    base_usage, base_cache = base
    growth = meter.settled_usage() - base_usage
    cache = meter.page_cache()
    reported = sum(pod.sizes.values())
    cache_change = None if cache is None or base_cache is None else cache - base_cache
    anonymous_growth = None if cache_change is None else growth - cache_change
    point = {
        "ops": ops,
        "models": len(pod.sizes),
        # Pack bases are in the growth and not in the sizes: fewer packs, a higher ratio.
        "packs": len(alive(pod.server.rt.packs())),
        "reported_bytes": reported,
        "growth_bytes": growth,
        "reported_over_growth": reported / growth if growth > 0 else None,
        "with_held_back_over_growth": (reported + held) / growth if growth > 0 else None,
        # File pages the kernel may take back without pressure (a DAMON scheme does on its own):
        # when they fall, the growth falls with them while the models keep their memory.
        "page_cache_change_bytes": cache_change,
        # Beside the target's ratio, not instead of it: against what the kernel cannot take back.
        "reported_over_growth_without_cache": (
            reported / anonymous_growth if anonymous_growth is not None and anonymous_growth > 0 else None
        ),
        **pod.counts,
    }
    progress(describe_point(point))
    return point


def run(ops: int = OPS, seed: int = 1) -> dict:
    folder = tempfile.mkdtemp(prefix="mr-churn-")
    meter = cgroup.Meter("churn")
    rng = random.Random(seed)
    per_pack = Settings.from_env({}).models_per_worker
    figures: dict = {"method": meter.method, "ops": ops, "capacity_bytes": CAPACITY_BYTES, "points": []}
    try:
        models = write_copies("python", folder, POOL)
        with MeshRuntime(models, "python", meter, models_per_worker=per_pack) as server:
            server.wait_settled()
            base, held = (meter.settled_usage(), meter.page_cache()), server.held_back()
            pod = Pod(server, CAPACITY_BYTES)
            progress(f"churn: filling a pod of {CAPACITY_BYTES // MiB} MiB capacity with python models")
            while len(pod.sizes) < POOL and pod.fits(len(pod.sizes)):
                pod.load(len(pod.sizes))
            figures["filled_with"] = len(pod.sizes)
            figures["points"].append(checkpoint(pod, meter, base, held, 0))
            for done in range(1, ops + 1):
                one_op(pod, rng)
                if done % CHECKPOINT == 0:
                    figures["points"].append(checkpoint(pod, meter, base, held, done))
            # Loads into a pack that ran long enough for its other models to move out (runtime/slowloads.py).
            figures["slow_load_moves"] = server.rt.log().count(SLOW_LOAD_LOGGED)
    except Exception as error:
        figures["error"] = f"{type(error).__name__}: {error}"[:300]
        progress(f"churn: ERROR {figures['error']}")
    finally:
        meter.remove()
        shutil.rmtree(folder, ignore_errors=True)
    return figures


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def describe_point(p: dict) -> str:
    cache = p.get("page_cache_change_bytes")
    return (
        f"churn after {p['ops']} ops: {p['models']} models in {p.get('packs', '-')} packs, "
        f"reported {p['reported_bytes'] / MiB:.1f} MiB, "
        f"cgroup grew {p['growth_bytes'] / MiB:.1f} MiB"
        + ("" if cache is None else f" (page cache {cache / MiB:+.1f} MiB)")
        + ", "
        f"reported / growth {_ratio(p['reported_over_growth'])} "
        f"({_ratio(p['with_held_back_over_growth'])} with held back; "
        f"{_ratio(p.get('reported_over_growth_without_cache'))} without the page cache's change)"
    )


def describe(figures: dict) -> list[str]:
    """The report's lines: one per checkpoint, then the range."""
    lines = [
        f"churn: {figures['ops']} operations on a pod of {figures['capacity_bytes'] // MiB} MiB capacity "
        f"(filled with {figures.get('filled_with', '-')} models first); memory by {figures['method']}"
    ]
    points = figures["points"]
    lines += [f"  {describe_point(p)}" for p in points]
    ratios = [p["reported_over_growth"] for p in points if p["reported_over_growth"] is not None]
    held = [p["with_held_back_over_growth"] for p in points if p["with_held_back_over_growth"] is not None]
    bare = [p.get("reported_over_growth_without_cache") for p in points]
    if ratios:
        lines.append(
            f"  reported / growth from {min(ratios):.3f} to {max(ratios):.3f}; with held back from "
            f"{min(held):.3f} to {max(held):.3f} (target: within 1.00-1.15 at every checkpoint)"
        )
    if ratios and None not in bare:
        lines.append(
            f"  reported / growth less the page cache's change (file pages the kernel takes back at will) "
            f"from {min(bare):.3f} to {max(bare):.3f}"
        )
    if points:
        last = points[-1]
        counts = {k: v for k, v in last.items() if k in ("loads", "unloads", "evictions", "infers")}
        failed = {k: v for k, v in last.items() if k.startswith("infer ")}
        lines.append(f"  operations: {counts}; calls that did not answer OK: {failed or 'none'}")
        moves = figures.get("slow_load_moves", "-")
        lines.append(f"  loads that ran long enough to move their pack's other models out: {moves}")
    if "error" in figures:
        lines.append(f"  stopped by {figures['error']}")
    return lines
