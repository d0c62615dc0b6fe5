"""The model life cycle's measurements, on one runtime with WORKERS_WARM=2.

1. Load latency from a warm spare: `loads` times, wait until the pool is settled (2 idle
   spares per fork server and no model worker, stable for 100 ms), time loadModel of the tiny
   echo model end to end from the client, unload it. Unload time is measured too.
2. Idle worker USS: each idle spare's USS once the pool settled and idled 1 s.
3. Memory returned after unload: settled tree USS before loading a model that allocates
   300 MiB, after loading it, and after unloading and re-settling; and the sizeInBytes the
   runtime reported against the growth measured.
4. predictModelSize latency over 200 calls for the echo folder.

All memory figures are USS read from outside with psutil (memory_full_info().uss), never what
the runtime says about itself. The targets are in bench/report.py.
"""

from __future__ import annotations

import statistics
import sys
import time

from bench.common import MiB, percentile
from meshtest import harness
from protos import model_runtime_pb2 as mm

WARM = 2
ALLOC_MIB = 300
SIZE_CALLS = 200
ECHO_KEY = '{"model_type":{"name":"python"}}'


def timed(call) -> float:
    """Milliseconds one call takes."""
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def pool_settled(rt: harness.Runtime) -> bool:
    """WARM idle spares per fork server, and no other worker."""
    wanted = rt.spares_wanted(WARM)
    return len(harness.alive(rt.spares())) == wanted and len(rt.workers()) == wanted


def wait_settled(rt: harness.Runtime, timeout: float = 30.0) -> None:
    """Settled (pool_settled), still so 100 ms later (time for the spares' hello)."""
    deadline = time.monotonic() + timeout
    while True:
        harness.wait_until(
            lambda: pool_settled(rt),
            timeout=max(0.1, deadline - time.monotonic()),
            what=f"{WARM} idle spares per fork server",
        )
        time.sleep(0.1)
        if pool_settled(rt):
            return


# -- the four measurements ------------------------------------------------------------


def bench_load(rt: harness.Runtime, loads: int) -> dict:
    folder = rt.model_dir("echo")
    load_ms, unload_ms = [], []
    for i in range(loads):
        wait_settled(rt)
        model_id = f"echo-{i}"
        load_ms.append(timed(lambda model_id=model_id: rt.load(model_id, folder)))
        unload_ms.append(timed(lambda model_id=model_id: rt.unload(model_id)))
    return {
        "load_ms": load_ms,
        "unload_ms": unload_ms,
        "load_p50_ms": percentile(load_ms, 50),
        "load_p99_ms": percentile(load_ms, 99),
        "unload_p50_ms": percentile(unload_ms, 50),
        "unload_p99_ms": percentile(unload_ms, 99),
    }


def bench_idle_uss(rt: harness.Runtime) -> dict:
    wait_settled(rt)
    time.sleep(1.0)
    sizes = [harness.uss(p.pid) / MiB for p in harness.alive(rt.spares())]
    return {"spare_uss_mib": sizes, "median_mib": statistics.median(sizes)}


def bench_memory_return(rt: harness.Runtime) -> dict:
    folder = rt.model_dir("ballast", harness.allocating_model(ALLOC_MIB))
    wait_settled(rt)
    before = rt.settled_uss(warm=WARM)
    reported = rt.load("ballast", folder).sizeInBytes
    loaded = rt.settled_uss(warm=WARM)
    rt.unload("ballast")
    after = rt.settled_uss(warm=WARM)
    growth = loaded - before
    return {
        "before_mib": before / MiB,
        "loaded_mib": loaded / MiB,
        "after_mib": after / MiB,
        "reported_mib": reported / MiB,
        "growth_mib": growth / MiB,
        "ratio": reported / growth if growth > 0 else float("nan"),
        "returned_diff_mib": (after - before) / MiB,
    }


def bench_predict_size(rt: harness.Runtime) -> dict:
    request = mm.PredictModelSizeRequest(
        modelId="echo-size", modelPath=rt.model_dir("echo"), modelKey=ECHO_KEY
    )
    sizes = set()
    samples = [
        timed(lambda: sizes.add(rt.mesh.predictModelSize(request, timeout=10).sizeInBytes))
        for _ in range(SIZE_CALLS)
    ]
    return {
        "ms": samples,
        "p50_ms": percentile(samples, 50),
        "p99_ms": percentile(samples, 99),
        "size_bytes": sorted(sizes),
    }


def stop(rt: harness.Runtime) -> None:
    """Stops the runtime; a process left behind is reported, not raised."""
    try:
        rt.stop()
    except Exception as error:
        print(f"warning: stopping the runtime: {error!r} (log: {rt.log_path})", file=sys.stderr)
