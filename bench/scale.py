"""scripts/bench --scale: many tiny models in one server, measured from outside, step by step.

One runtime with the product's settings (every installed framework preloaded,
WORKERS_WARM=2) runs in a memory cgroup of its own (meshtest/cgroup.py; the PSS
sum of its tree where none can be made). N tiny iris models of one format
(scripts/make_examples.py, copied into one folder each, as the puller lays
them out) are loaded two at a time, as model-mesh does, in steps (default
50, 200, 500, 1000 models in all). After each step, with the pool settled:

- growth per model: (usage now - usage before the first load) / N;
- reported / growth: the sum of the sizeInBytes that loadModel returned over
  that growth (model-mesh packs the pod by those sizes: below 1.00 it
  over-commits); and the same with what capacityInBytes held back at start
  for packs not yet full, whose base their models' sizes do not yet cover
  (model-mesh fills the pod up to capacity: below 1.00 it over-commits);
- loadModel p50/p99 of that step's loads, and the first ModelInfer of each
  freshly loaded model (called right after its load, as traffic arrives);
- ModelInfer p50/p99 over sequential calls, each to a random loaded model;
- idle CPU of the whole process tree over 10 s, in % of one core (the
  scheduler's run time of every thread, /proc/PID/task/TID/schedstat);
- processes in the tree and the descriptors the front holds open.

Once 500 models are loaded (or at the last step, if fewer are asked for), a
tenth of the model workers (or packs) are SIGKILLed under traffic (bench/scale_faults.py).
Then every model is unloaded, two at a time; the time that takes until every
model's worker is reaped, and the memory left above the start.

With --peer mlserver, MLServer 1.7.1 (one process, mlserver-sklearn) is
measured the same way in the same run with the same N sklearn models, loaded
through its repository API.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import shutil
import sys
import tempfile
import time

from bench import scale_faults
from bench.common import REPO, MiB, percentile, progress
from bench.scale_servers import MeshRuntime, MLServerRepository, ScaleServer
from meshtest import cgroup, harness
from runtime.settings import Settings

STEPS = (50, 200, 500, 1000)
LOADERS = 2  # model-mesh loads two models at a time per runtime by default
RANDOM_CALLS = 500
IDLE_SECONDS = 10.0
SETTLE_AFTER_UNLOAD_S = 3.0

sys.path.insert(0, os.path.join(REPO, "scripts"))
import make_examples  # noqa: E402  (scripts/make_examples.py)


def write_copies(fmt: str, folder: str, count: int) -> list[str]:
    """`count` folders holding the example model of `fmt`; raises if its framework is missing."""
    example = next((e for e in make_examples.EXAMPLES if e.format == fmt), None)
    if example is None:
        raise ValueError(f"no example model of format {fmt!r}")
    if example.missing():
        raise RuntimeError(f"{fmt}: {', '.join(example.missing())} not installed")
    source = os.path.join(folder, "source")
    os.makedirs(source)
    example.build(source, make_examples.iris())
    copies = []
    for index in range(count):
        target = os.path.join(folder, f"{fmt}-{index:04d}")
        shutil.copytree(source, target)
        copies.append(target)
    return copies


def timed_ms(call, *args) -> float:
    start = time.perf_counter()
    call(*args)
    return (time.perf_counter() - start) * 1000


def run_time_ns(pids: list[int]) -> dict[str, int]:
    """Nanoseconds each thread of `pids` has run, by /proc/PID/task/TID, from the scheduler's own count.

    Not psutil's cpu_times: those count in 10 ms ticks per process, and a
    thousand idle workers each use about a millisecond in ten seconds.
    """
    used = {}
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{pid}/task/{task}/schedstat") as schedstat:
                    used[f"{pid}/{task}"] = int(schedstat.read().split()[0])
            except OSError:
                pass
    return used


def idle_cpu_percent(root_pid: int, seconds: float) -> float:
    """CPU the whole tree used over `seconds` of no traffic, in % of one core."""
    pids = [process.pid for process in harness.tree(root_pid)]
    before = run_time_ns(pids)
    time.sleep(seconds)
    after = run_time_ns(pids)
    spent = sum(after[task] - before[task] for task in after if task in before)
    return 100 * spent / 1e9 / seconds


def load_step(
    server: ScaleServer, indexes: list[int], loaders: int = LOADERS
) -> tuple[list[float], list[float], int, float]:
    """Loads `indexes` `loaders` at a time, each followed by its first call.

    Returns the load times and first-call times in ms, the bytes reported and the seconds it all took.
    """

    def one(index: int) -> tuple[float, float, int]:
        start = time.perf_counter()
        size = server.load(index)
        loaded = time.perf_counter()
        server.infer(index)
        return (loaded - start) * 1000, (time.perf_counter() - loaded) * 1000, size

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(loaders) as pool:
        results = list(pool.map(one, indexes))
    wall = time.perf_counter() - start
    return [r[0] for r in results], [r[1] for r in results], sum(r[2] for r in results), wall


def measure_step(
    server: ScaleServer,
    meter: cgroup.Meter,
    base: tuple[int, int | None],
    loaded: int,
    reported: int,
    held: int,
) -> dict:
    """The step's figures, against `base` (usage, page cache) at the start."""
    server.wait_settled()
    usage = meter.settled_usage()
    growth = usage - base[0]
    cache = meter.page_cache()
    # Beside the growth, not instead of it: the growth less what the page cache moved by (file pages
    # the kernel takes back at will, as a proactive reclaimer does over a long run).
    bare = None if cache is None or base[1] is None else growth - (cache - base[1])
    calls = [timed_ms(server.infer, random.randrange(loaded)) for _ in range(RANDOM_CALLS)]
    return {
        "models": loaded,
        "growth_bytes": growth,
        "growth_per_model_mib": growth / loaded / MiB,
        "reported_bytes": reported,
        # None: nothing to compare (a server that reports no sizes, or no growth seen)
        "reported_over_growth": reported / growth if growth > 0 and reported else None,
        "with_held_back_over_growth": (reported + held) / growth if growth > 0 and reported else None,
        "reported_over_growth_without_cache": reported / bare if bare and bare > 0 and reported else None,
        "infer_p50_ms": percentile(calls, 50),
        "infer_p99_ms": percentile(calls, 99),
        "idle_cpu_percent": idle_cpu_percent(server.root_pid(), IDLE_SECONDS),
        "processes": len(harness.alive(harness.tree(server.root_pid()))),
        "front_fds": server.front_fds(),
    }


def unload_all(server: ScaleServer, meter: cgroup.Meter, base: int, loaded: int) -> dict:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(LOADERS) as unloaders:
        list(unloaders.map(server.unload, range(loaded)))
    server.wait_unloaded()
    seconds = time.perf_counter() - start
    # A server may give memory back a moment after its last exit (mesh-runtime's
    # front trims its heap once exits stop for a second: runtime/heaptrim.py).
    time.sleep(SETTLE_AFTER_UNLOAD_S)
    left = meter.settled_usage() - base
    return {"unload_all_s": seconds, "left_bytes": left}


def run_server(
    server: ScaleServer, meter: cgroup.Meter, steps: tuple[int, ...], loaders: int = LOADERS
) -> dict:
    """Every step on one started server; a step that fails ends the run with what was measured."""
    server.wait_settled()
    base = meter.settled_usage()
    base_cache = meter.page_cache()
    held = server.held_back()  # read once, at start, as model-mesh reads capacity
    figures: dict = {"method": meter.method, "base_bytes": base, "held_back_bytes": held, "steps": []}
    loaded, reported = 0, 0
    try:
        for target in steps:
            progress(f"{server.name}: loading models {loaded}..{target - 1}")
            load_ms, first_ms, added, wall = load_step(server, list(range(loaded, target)), loaders)
            loaded, reported = target, reported + added
            step = measure_step(server, meter, (base, base_cache), loaded, reported, held)
            step.update(
                load_p50_ms=percentile(load_ms, 50),
                load_p99_ms=percentile(load_ms, 99),
                first_call_p50_ms=percentile(first_ms, 50),
                load_step_s=wall,
            )
            figures["steps"].append(step)
            print_step(server.name, step)
            if wants_faults(server, figures, loaded, steps):
                figures["faults"] = scale_faults.run_faults(server, meter, base, loaded, held)
                print(f"  {server.name} {scale_faults.describe(figures['faults'])}", file=sys.stderr)
        progress(f"{server.name}: unloading all {loaded}")
        figures.update(unload_all(server, meter, base, loaded))
        cache = meter.page_cache()
        if cache is not None and base_cache is not None:
            figures["left_page_cache_bytes"] = cache - base_cache
    except Exception as error:
        figures["error"] = f"{type(error).__name__}: {error}"[:300]
        print(f"{server.name}: ERROR {figures['error']}", file=sys.stderr)
    return figures


def wants_faults(server: ScaleServer, figures: dict, loaded: int, steps: tuple[int, ...]) -> bool:
    """The faults phase runs once, on mesh-runtime, at FAULTS_AT models or at the last step below it."""
    if not isinstance(server, MeshRuntime) or "faults" in figures:
        return False
    return loaded >= scale_faults.FAULTS_AT or loaded == max(steps)


def print_step(name: str, s: dict) -> None:
    ratio = "-" if s["reported_over_growth"] is None else f"{s['reported_over_growth']:.2f}"
    print(
        f"  {name} N={s['models']}: {s['growth_per_model_mib']:.2f} MiB/model, reported/growth {ratio}, "
        f"load p50 {s['load_p50_ms']:.1f} ms, first call p50 {s['first_call_p50_ms']:.1f} ms, "
        f"infer p50 {s['infer_p50_ms']:.2f} ms, idle CPU {s['idle_cpu_percent']:.1f} %",
        file=sys.stderr,
        flush=True,
    )


def run(
    fmt: str = "python",
    steps: tuple[int, ...] = STEPS,
    peer: str | None = None,
    models_per_worker: int | None = None,
    loaders: int = LOADERS,
) -> dict:
    """The whole scale benchmark: mesh-runtime with `fmt` models, then the peer with sklearn ones.

    models_per_worker: mesh-runtime's MODELS_PER_WORKER (None: the product's default);
    loaders: how many loads run at once (model-mesh's default: 2)."""
    if models_per_worker is None:
        models_per_worker = Settings.from_env({}).models_per_worker
    figures: dict = {
        "format": fmt,
        "steps_wanted": list(steps),
        "models_per_worker": models_per_worker,
        "loaders": loaders,
    }
    folder = tempfile.mkdtemp(prefix="mr-scale-")
    try:
        systems = [("mesh-runtime", fmt, MeshRuntime)]
        if peer == "mlserver":
            systems.append(("MLServer 1.7.1", "sklearn", MLServerRepository))
        for name, model_format, server_class in systems:
            models = write_copies(model_format, os.path.join(folder, name.split()[0]), max(steps))
            meter = cgroup.Meter(name.split()[0].lower())
            progress(f"{name}: {len(models)} {model_format} models; memory by {meter.method}")
            try:
                packing = {"models_per_worker": models_per_worker} if server_class is MeshRuntime else {}
                with server_class(models, model_format, meter, **packing) as server:
                    figures[name] = {"format": model_format, **run_server(server, meter, steps, loaders)}
            finally:
                meter.remove()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return figures


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def print_report(figures: dict) -> None:
    """One table: a column per system and step."""
    columns = [
        (name, step)
        for name, system in figures.items()
        if isinstance(system, dict) and "steps" in system
        for step in system["steps"]
    ]
    if not columns:
        print("scale: nothing measured")
        return
    rows = [
        ("growth per model, MiB", lambda s: f"{s['growth_per_model_mib']:.2f}"),
        (
            "reported / growth",
            lambda s: _ratio(s["reported_over_growth"]),
        ),
        (
            "(reported + held back for open packs) / growth",
            lambda s: _ratio(s["with_held_back_over_growth"]),
        ),
        (
            "reported / (growth less the page cache's change)",
            lambda s: _ratio(s.get("reported_over_growth_without_cache")),
        ),
        ("loadModel p50 / p99, ms", lambda s: f"{s['load_p50_ms']:.1f} / {s['load_p99_ms']:.1f}"),
        ("first call p50, ms", lambda s: f"{s['first_call_p50_ms']:.1f}"),
        ("ModelInfer p50 / p99, ms", lambda s: f"{s['infer_p50_ms']:.2f} / {s['infer_p99_ms']:.2f}"),
        ("idle CPU, % of a core", lambda s: f"{s['idle_cpu_percent']:.1f}"),
        ("processes", lambda s: str(s["processes"])),
        ("front's open descriptors", lambda s: str(s["front_fds"])),
        ("time to load the step (and first calls), s", lambda s: f"{s['load_step_s']:.1f}"),
    ]
    header = [
        "measure",
        *(f"{name.split()[0]} {figures[name]['format']} N={s['models']}" for name, s in columns),
    ]
    table = [header, *([label, *(show(s) for _, s in columns)] for label, show in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    print()
    for system, values in figures.items():
        if isinstance(values, dict) and "method" in values:
            print(f"{system}: memory measured by {values['method']}")
    for row in table:
        print(
            "  ".join(
                cell.ljust(widths[i]) if i == 0 else cell.rjust(widths[i]) for i, cell in enumerate(row)
            )
        )
    for name, system in figures.items():
        if not isinstance(system, dict) or "steps" not in system:
            continue
        if "unload_all_s" in system:
            cache = system.get("left_page_cache_bytes")
            of_it = (
                ""
                if cache is None
                else f" ({cache / MiB:+.1f} MiB of it page cache: files read, reclaimable)"
            )
            print(
                f"{name}: unloading all {system['steps'][-1]['models']} took {system['unload_all_s']:.1f} s, "
                f"{system['left_bytes'] / MiB:+.1f} MiB left above the start{of_it}"
            )
        if "faults" in system:
            print(f"{name} {scale_faults.describe(system['faults'])}")
        if "error" in system:
            print(f"{name}: stopped by {system['error']}")
