"""Benchmarks a real mesh-runtime against its performance targets; prints a table.

One runtime is started with WORKERS_WARM=2 through meshtest/harness.py (a
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

5. The data plane (bench/plan.py, run after the table above with
   its own table): ModelInfer req/s and p50/p99 under h2load at concurrency 1
   and 16 for a bare grpc.aio server, mesh-runtime (echo, scikit-learn iris,
   1 MiB) and, with --peer mlserver, MLServer 1.7.1; ratios against the
   targets. --skip-dataplane leaves it out, --dataplane-only runs only it.

--instructions-only runs bench/instructions.py instead: instructions
per ModelInfer call under callgrind, which moves only when the code does.

--scale runs bench/scale.py instead: N tiny models of one --format in one
runtime in its own memory cgroup, in --steps, measured from outside (memory
per model, reported sizes against it, load and call latencies, idle CPU,
descriptors; then unloading them all); with --peer mlserver, MLServer with
the same N sklearn models beside it.

--packs runs bench/pack_recycle.py and bench/pack_churn.py instead: what a
pack recycle costs an unload and the pack's other calls, then --ops mixed
loads, unloads and calls on a pod kept near its capacity, with the reported
sizes against the cgroup's growth after every thousand.

--cpu-limit runs bench/cpulimit.py instead: the echo model under h2load with
the runtime in a cgroup with a CPU quota of one core, with BUSY_POLL_US=1000,
0 and the default (off) side by side.

Benchmarks report, they do not fail: the exit code is 0 even when a target is
missed, 1 only when a measurement could not be made.

usage: scripts/bench [--loads N] [--json PATH] [--skip-dataplane | --dataplane-only]
                     [--peer mlserver] [--rounds N]
       scripts/bench --instructions-only [--json PATH]
       scripts/bench --scale [--format F] [--steps 50,200,500,1000] [--peer mlserver] [--loaders N]
                             [--json PATH]
       scripts/bench --packs [--ops 10000] [--json PATH]
       scripts/bench --cpu-limit [--rounds N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import traceback

from bench import cpulimit, instructions, lifecycle, pack_churn, pack_recycle, plan, report, scale
from bench.common import damon_reclaim, progress
from meshtest import harness


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "damon_reclaim": damon_reclaim(),
    }


def run_sections(rt: harness.Runtime, loads: int) -> tuple[dict, list, bool]:
    """Runs each measurement; one that fails is shown as ERROR and the others still run."""
    plan = [
        (
            "1. load latency from a warm spare",
            "load",
            lambda: lifecycle.bench_load(rt, loads),
            lambda r: report.rows_load(r, loads),
        ),
        ("2. idle worker USS", "idle_uss", lambda: lifecycle.bench_idle_uss(rt), report.rows_idle),
        (
            "3. memory returned after unload",
            "memory_return",
            lambda: lifecycle.bench_memory_return(rt),
            report.rows_memory,
        ),
        (
            "4. predictModelSize latency",
            "predict_size",
            lambda: lifecycle.bench_predict_size(rt),
            report.rows_size,
        ),
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
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=int, default=50, help="timed loads in part 1 (default 50)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    parser.add_argument("--skip-dataplane", action="store_true", help="leave out the data-plane benchmark")
    parser.add_argument("--dataplane-only", action="store_true", help="run only the data-plane benchmark")
    parser.add_argument(
        "--instructions-only",
        action="store_true",
        help="run only the instruction count per call under callgrind (bench/instructions.py)",
    )
    parser.add_argument("--scale", action="store_true", help="run only the scale benchmark (bench/scale.py)")
    parser.add_argument(
        "--packs",
        action="store_true",
        help="run only the packs benchmark (bench/pack_recycle.py, bench/pack_churn.py)",
    )
    parser.add_argument(
        "--cpu-limit",
        action="store_true",
        help="run only the CPU-quota benchmark of busy polling (bench/cpulimit.py)",
    )
    parser.add_argument(
        "--ops", type=int, default=pack_churn.OPS, help="packs: churn operations (default %(default)s)"
    )
    parser.add_argument(
        "--format", default="python", help="scale: the format of the tiny models (default python)"
    )
    parser.add_argument(
        "--steps",
        default=",".join(map(str, scale.STEPS)),
        help="scale: models loaded in all after each step (default %(default)s)",
    )
    parser.add_argument(
        "--models-per-worker",
        type=int,
        default=None,
        help="scale: run mesh-runtime with MODELS_PER_WORKER set to this (1: a worker per model; "
        "default: the product's default)",
    )
    parser.add_argument(
        "--loaders",
        type=int,
        default=scale.LOADERS,
        help="scale: loads at once, each followed by its first call (default %(default)s, as model-mesh)",
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
    if info["damon_reclaim"]:
        print(
            f"memory: the kernel pages cold memory out on its own here ({', '.join(info['damon_reclaim'])}): "
            "a cgroup's usage may fall over a long run while nothing in it changes"
        )
    if args.scale:
        return run_scale(args, info)
    if args.packs:
        return run_packs(args, info)
    if args.cpu_limit:
        return run_cpu_limit(args, info)
    if args.dataplane_only:
        figures = {}
        ok = run_dataplane(args, figures)
        write_json(args, info, figures)
        return 0 if ok else 1
    if args.instructions_only:
        return run_instructions(args, info)
    rt = harness.Runtime(preload_frameworks=True, WORKERS_WARM=str(lifecycle.WARM))
    try:
        progress("starting the runtime")
        rt.start()
        figures, sections, ok = run_sections(rt, args.loads)
    except Exception:
        traceback.print_exc()
        print(f"runtime log kept ({rt.log_path}), its end:\n{rt.log()[-4000:]}", file=sys.stderr)
        return 1
    finally:
        lifecycle.stop(rt)
    print()
    report.print_lifecycle(sections)
    if ok:
        shutil.rmtree(rt.root, ignore_errors=True)
    else:
        print(f"\nruntime log kept: {rt.log_path}", file=sys.stderr)
    if not args.skip_dataplane:
        ok = run_dataplane(args, figures) and ok
    write_json(args, info, figures)
    return 0 if ok else 1


def run_dataplane(args, figures: dict) -> bool:
    """Part 5 (bench/plan.py): prints its table; its figures go to figures["dataplane"]."""
    progress("5. data plane (h2load)")
    try:
        figures["dataplane"], ok = plan.run(peer=args.peer, rounds=args.rounds)
    except Exception as error:
        traceback.print_exc()
        figures["dataplane"] = {"error": repr(error)}
        print(f"\ndata plane: ERROR {error!r}")
        return False
    report.print_dataplane(figures["dataplane"])
    return ok


def run_instructions(args, info: dict) -> int:
    """bench/instructions.py: instructions per call, which timings on this machine cannot show."""
    return run_one(
        args, info, "instructions", lambda: instructions.run(calls=1000), instructions.print_report
    )


def run_one(args, info: dict, key: str, measure, print_report) -> int:
    """A benchmark that prints one report: its figures go under `key`; 1 if it could not run."""
    try:
        figures = {key: measure()}
    except Exception as error:
        traceback.print_exc()
        print(f"\n{key}: ERROR {error!r}")
        return 1
    print_report(figures[key])
    write_json(args, info, figures)
    return 0


def run_scale(args, info: dict) -> int:
    """bench/scale.py: one table, a column per system and step."""
    try:
        steps = tuple(int(step) for step in args.steps.split(","))
    except ValueError:
        print(f"--steps: {args.steps!r} is not a list of numbers", file=sys.stderr)
        return 2
    figures = {"scale": scale.run(args.format, steps, args.peer, args.models_per_worker, args.loaders)}
    scale.print_report(figures["scale"])
    write_json(args, info, figures)
    return 1 if any("error" in v for v in figures["scale"].values() if isinstance(v, dict)) else 0


def run_packs(args, info: dict) -> int:
    """bench/pack_recycle.py, then bench/pack_churn.py; each prints its lines."""
    figures: dict = {}
    try:
        figures["recycle"] = pack_recycle.run()
    except Exception as error:
        traceback.print_exc()
        figures["recycle"] = {"error": repr(error)}
    figures["churn"] = pack_churn.run(args.ops)
    print()
    if "error" in figures["recycle"]:
        print(f"recycle: ERROR {figures['recycle']['error']}")
    else:
        print("\n".join(pack_recycle.describe(figures["recycle"])))
    print("\n".join(pack_churn.describe(figures["churn"])))
    write_json(args, info, figures)
    return 1 if any("error" in part for part in figures.values()) else 0


def run_cpu_limit(args, info: dict) -> int:
    """bench/cpulimit.py: one table of the busy-polling settings under a CPU quota."""
    rounds = max(args.rounds, cpulimit.ROUNDS)
    return run_one(args, info, "cpu_limit", lambda: cpulimit.run(rounds=rounds), cpulimit.print_report)


def write_json(args, info: dict, figures: dict) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "loads": args.loads, **figures}, f, indent=2)
        print(f"\nfigures written to {args.json}")


if __name__ == "__main__":
    sys.exit(main())
