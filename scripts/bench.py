#!/usr/bin/env python3
"""Benchmarks a real mesh-runtime against its performance targets; prints a table.

One runtime is started with WORKERS_WARM=2 through tests/harness.py (a
subprocess with private temp folders, talked to over gRPC like model-mesh
does). All memory figures are USS read from outside with psutil
(memory_full_info().uss), never what the runtime says about itself.

1. Load latency from a warm spare: --loads times, wait until the pool is
   settled (2 idle spares and no model worker, stable for 100 ms), time
   loadModel of the tiny echo model end to end from the client, unload it.
   p50 and p99 (nearest rank) in ms; target p50 <= 10 ms. Unload time is
   reported too, without a target.
2. Idle worker USS: each idle spare's USS once the pool settled and idled 1 s;
   median in MiB; target <= 6 MiB.
3. Memory returned after unload: settled tree USS before loading a model that
   allocates 300 MiB, after loading it, and after unloading and re-settling.
   Targets: after - before within 2 MiB; reported sizeInBytes / measured
   growth within 1 +- 10 %.
4. predictModelSize latency over 200 calls for the echo folder; p50 and p99;
   target < 5 ms.

5. The data plane (scripts/bench_dataplane.py, run after the table above with
   its own table): ModelInfer req/s and p50/p99 under h2load at concurrency 1
   and 16 for a bare grpc.aio server, mesh-runtime (echo, scikit-learn iris,
   1 MiB) and, with --peer mlserver, MLServer 1.7.1; ratios against issue 3's
   targets. --skip-dataplane leaves it out, --dataplane-only runs only it.

--instructions-only runs scripts/bench_instructions.py instead: instructions
per ModelInfer call under callgrind, which moves only when the code does.

Benchmarks report, they do not fail: the exit code is 0 even when a target is
missed, 1 only when a measurement could not be made.

usage: scripts/bench [--loads N] [--json PATH] [--skip-dataplane | --dataplane-only]
                     [--peer mlserver] [--rounds N]
       scripts/bench --instructions-only [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

import harness  # noqa: E402  (tests/harness.py)

from protos import model_runtime_pb2 as mm  # noqa: E402

MiB = harness.MiB
WARM = 2
ALLOC_MIB = 300
SIZE_CALLS = 200
ECHO_KEY = '{"model_type":{"name":"python"}}'


# -- small helpers ------------------------------------------------------------------


def percentile(samples: list[float], p: float) -> float:
    """Nearest-rank percentile (with 50 samples p99 is the slowest one)."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def timed(call) -> float:
    """Milliseconds one call takes."""
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1000


def progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


def pool_settled(rt: harness.Runtime) -> bool:
    return len(harness.alive(rt.spares())) == WARM and len(rt.workers()) == WARM


def wait_settled(rt: harness.Runtime, timeout: float = 30.0) -> None:
    """WARM idle spares and nothing else, still so 100 ms later (time for the spares' hello)."""
    deadline = time.monotonic() + timeout
    while True:
        harness.wait_until(
            lambda: pool_settled(rt),
            timeout=max(0.1, deadline - time.monotonic()),
            what=f"{WARM} idle spares",
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


# -- the table --------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def rows_load(r: dict, loads: int) -> list[tuple]:
    return [
        (
            f"load from warm spare, p50 ({loads} loads)",
            f"{r['load_p50_ms']:.1f} ms",
            "p50 <= 10 ms",
            verdict(r["load_p50_ms"] <= 10),
        ),
        ("load from warm spare, p99", f"{r['load_p99_ms']:.1f} ms", "", ""),
        ("unload, p50 / p99", f"{r['unload_p50_ms']:.1f} / {r['unload_p99_ms']:.1f} ms", "", ""),
    ]


def rows_idle(r: dict) -> list[tuple]:
    each = ", ".join(f"{s:.2f}" for s in r["spare_uss_mib"])
    return [
        ("idle spare USS, median", f"{r['median_mib']:.2f} MiB", "<= 6 MiB", verdict(r["median_mib"] <= 6)),
        ("idle spare USS, each", f"{each} MiB", "", ""),
    ]


def rows_memory(r: dict) -> list[tuple]:
    return [
        ("tree USS before load (settled)", f"{r['before_mib']:.1f} MiB", "", ""),
        (f"tree USS with {ALLOC_MIB} MiB model", f"{r['loaded_mib']:.1f} MiB", "", ""),
        ("  measured growth", f"{r['growth_mib']:.1f} MiB", "", ""),
        ("  reported sizeInBytes", f"{r['reported_mib']:.1f} MiB", "", ""),
        ("  ratio reported / growth", f"{r['ratio']:.3f}", "1 +- 10 %", verdict(abs(r["ratio"] - 1) <= 0.10)),
        ("tree USS after unload (settled)", f"{r['after_mib']:.1f} MiB", "", ""),
        (
            "  after - before",
            f"{r['returned_diff_mib']:+.2f} MiB",
            "within 2 MiB",
            verdict(abs(r["returned_diff_mib"]) <= 2),
        ),
    ]


def rows_size(r: dict) -> list[tuple]:
    return [
        (
            f"predictModelSize, p50 ({SIZE_CALLS} calls)",
            f"{r['p50_ms']:.2f} ms",
            "< 5 ms",
            verdict(r["p50_ms"] < 5),
        ),
        ("predictModelSize, p99", f"{r['p99_ms']:.2f} ms", "< 5 ms", verdict(r["p99_ms"] < 5)),
        (
            "  predicted size of the echo model",
            " / ".join(f"{b / MiB:.1f}" for b in r["size_bytes"]) + " MiB",
            "",
            "",
        ),
    ]


def print_table(sections: list[tuple[str, list[tuple]]]) -> None:
    header = ("measure", "value", "target", "")
    widths = [max(len(str(row[i])) for _, rows in sections for row in [header, *rows]) for i in range(4)]
    line = "  ".join("-" * w for w in widths)

    def show(row):
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())

    show(header)
    for title, rows in sections:
        print(line)
        print(title)
        for row in rows:
            show(row)


# -- running it all ------------------------------------------------------------------------


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
    }


def run_sections(rt: harness.Runtime, loads: int) -> tuple[dict, list, bool]:
    """Runs each measurement; one that fails is shown as ERROR and the others still run."""
    plan = [
        (
            "1. load latency from a warm spare",
            "load",
            lambda: bench_load(rt, loads),
            lambda r: rows_load(r, loads),
        ),
        ("2. idle worker USS", "idle_uss", lambda: bench_idle_uss(rt), rows_idle),
        ("3. memory returned after unload", "memory_return", lambda: bench_memory_return(rt), rows_memory),
        ("4. predictModelSize latency", "predict_size", lambda: bench_predict_size(rt), rows_size),
    ]
    figures, sections, ok = {}, [], True
    for title, key, measure, rows in plan:
        progress(title)
        try:
            figures[key] = measure()
            sections.append((title, rows(figures[key])))
        except Exception as error:
            traceback.print_exc()
            figures[key] = {"error": repr(error)}
            sections.append((title, [("ERROR", repr(error)[:60], "", "")]))
            ok = False
    return figures, sections, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=int, default=50, help="timed loads in part 1 (default 50)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--skip-dataplane", action="store_true", help="leave out the data-plane benchmark")
    parser.add_argument("--dataplane-only", action="store_true", help="run only the data-plane benchmark")
    parser.add_argument(
        "--instructions-only",
        action="store_true",
        help="run only the instruction count per call under callgrind (scripts/bench_instructions.py)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="data plane: repeat its interleaved sequence and report each point's median round (default 1)",
    )
    parser.add_argument(
        "--peer",
        choices=["mlserver"],
        help="data plane: also measure MLServer 1.7.1 (installed into .bench/mlserver-venv on first use)",
    )
    args = parser.parse_args()
    if args.loads < 1:
        parser.error("--loads must be at least 1")
    if args.skip_dataplane and (args.dataplane_only or args.peer):
        parser.error("--skip-dataplane goes with neither --dataplane-only nor --peer")

    info = machine()
    print(f"machine: {info['cpus']} cpus, python {info['python']}, {info['platform']}")
    # The fork server's preload sets how big every worker's address space is, and
    # reading a worker's USS (smaps_rollup) walks all of it: say which one ran.
    from runtime.settings import Settings

    print(f"WORKER_PRELOAD: {','.join(Settings.from_env().worker_preload)}")
    if args.dataplane_only:
        figures = {}
        ok = run_dataplane(args, figures)
        write_json(args, info, figures)
        return 0 if ok else 1
    if args.instructions_only:
        return run_instructions(args, info)
    rt = harness.Runtime(preload_frameworks=True, WORKERS_WARM=str(WARM))
    try:
        progress("starting the runtime")
        rt.start()
        figures, sections, ok = run_sections(rt, args.loads)
    except Exception:
        traceback.print_exc()
        print(f"runtime log kept ({rt.log_path}), its end:\n{rt.log()[-4000:]}", file=sys.stderr)
        return 1
    finally:
        stop(rt)
    print()
    print_table(sections)
    if ok:
        shutil.rmtree(rt.root, ignore_errors=True)
    else:
        print(f"\nruntime log kept: {rt.log_path}", file=sys.stderr)
    if not args.skip_dataplane:
        ok = run_dataplane(args, figures) and ok
    write_json(args, info, figures)
    return 0 if ok else 1


def run_dataplane(args, figures: dict) -> bool:
    """Part 5 (scripts/bench_dataplane.py): prints its table; its figures go to figures["dataplane"]."""
    import bench_dataplane  # scripts/bench_dataplane.py, beside this file

    progress("5. data plane (h2load)")
    try:
        figures["dataplane"], ok = bench_dataplane.run(peer=args.peer, rounds=args.rounds)
    except Exception as error:
        traceback.print_exc()
        figures["dataplane"] = {"error": repr(error)}
        print(f"\ndata plane: ERROR {error!r}")
        return False
    bench_dataplane.print_report(figures["dataplane"])
    return ok


def run_instructions(args, info: dict) -> int:
    """scripts/bench_instructions.py: instructions per call, which timings on this machine cannot show."""
    import bench_instructions  # scripts/bench_instructions.py, beside this file

    try:
        figures = {"instructions": bench_instructions.run(calls=1000)}
    except Exception as error:
        traceback.print_exc()
        print(f"\ninstructions: ERROR {error!r}")
        return 1
    bench_instructions.print_report(figures["instructions"])
    write_json(args, info, figures)
    return 0


def write_json(args, info: dict, figures: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "loads": args.loads, **figures}, f, indent=2)
        print(f"\nfigures written to {args.json}")


def stop(rt: harness.Runtime) -> None:
    """Stops the runtime; a process left behind is reported, not raised."""
    try:
        rt.stop()
    except Exception as error:
        print(f"warning: stopping the runtime: {error!r} (log: {rt.log_path})", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
