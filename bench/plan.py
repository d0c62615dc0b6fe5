"""The data-plane benchmark's plan: its cases, their order and rounds, and the run of them all.

Cases (each at concurrency 1, 8 and 16, driven by h2load; see bench/h2load.py for how a point is
measured and checked):
  (a) bench/canned_server.py: a bare grpc.aio server answering every call
      with fixed response bytes (the ceiling of a Python front),
  (a') the same on uvloop, the event loop mesh-runtime's front runs on by
      default (a reference, not a target: what the loop alone changes),
  (a2) the same on uvloop with --hop: every call's bytes go over ZeroMQ to a
      child process that answers the fixed bytes (the ceiling of a front that
      forwards; not a target, it shows what the hop alone costs),
  (b) mesh-runtime serving an echo model (FP32 [1,4] in, the same out),
  (b') the same with BUSY_POLL_US=1000 (a reference: whether the front's
      busy polling, off by default, would pay for its CPU on this machine),
  (c) mesh-runtime serving a scikit-learn LogisticRegression trained on iris
      (sklearn format; FP32 [1,4] in, `predict` out; should that format not
      load, a custom python model doing the same, and the output says so),
  (d) with --peer mlserver: MLServer 1.7.1 + mlserver-sklearn serving the same
      joblib file (parallel_workers 0), installed into .bench/mlserver-venv,
and a 1 MiB request (FP32 [1, 262144] in raw_input_contents) for (a), (b)
and (d) (an echo MLServer model: a 10-line MLModel returning its inputs).

Each point is a 1 s h2load warm-up run, then the measured run (8 s by default). Every server
is started first and the points are interleaved, so that a burst of other work on the machine
hits the cases being compared alike; --rounds N repeats the sequence and each point reports
its median round.

The runtime under test runs with its defaults (only ports and private
folders are set, plus WORKERS_WARM=2, which is the default the test harness
lowers to 1). Benchmarks report, they do not fail: a missed target is MISS,
exit code 0; the exit code is 1 only when a point could not be measured.

usage: .venv/bin/python -m bench.plan [--peer mlserver] [--duration S] [--warmup S] [--rounds N] [--json PATH]
       (scripts/bench runs it after its own table; scripts/bench --dataplane-only runs only this)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback

from bench.common import progress
from bench.h2load import Target, measure
from bench.installers import MLSERVER_VENV, ensure_h2load, package_version
from bench.payloads import (
    BIG,
    SMALL,
    CheckFailed,
    big_request,
    echo_response,
    expect_anything,
    expect_echo,
    expect_iris,
    mesh_header_lines,
    small_request,
)
from bench.report import per_call_targets, print_dataplane, targets
from bench.servers import RUNTIME_ENV, Canned, MLServer, load_iris_model, stop_runtime, train_iris
from meshtest import harness

CONCURRENCY = (1, 8, 16)
CASE_A, CASE_B, CASE_C = "(a) grpc.aio canned", "(b) mesh-runtime echo", "(c) mesh-runtime sklearn"
CASE_A2 = "(a2) canned via a ZeroMQ hop"
CASE_B_POLLING = "(b') mesh-runtime echo, polling"
POLLING_ENV = {"BUSY_POLL_US": "1000"}
CASE_A_UVLOOP = "(a') grpc.aio canned, uvloop"
CASE_D_SKLEARN, CASE_D_ECHO = "(d) MLServer sklearn", "(d) MLServer echo"
# Every (case, payload) in the order the table shows them.
ROWS = (
    (CASE_A, SMALL),
    (CASE_A, BIG),
    (CASE_A_UVLOOP, SMALL),
    (CASE_A2, SMALL),
    (CASE_B, SMALL),
    (CASE_B, BIG),
    (CASE_B_POLLING, SMALL),
    (CASE_C, SMALL),
    (CASE_D_SKLEARN, SMALL),
    (CASE_D_ECHO, BIG),
)


def run(
    duration: float = 8.0, warmup: float = 1.0, peer: str | None = None, rounds: int = 1
) -> tuple[dict, bool]:
    """Measures every point; returns (figures, ok). ok is False when a point could not be measured.

    Every server is started first and the points are interleaved (for each
    payload and concurrency: a, b, c, d), so that a burst of other work on
    the machine hits the cases being compared alike. With rounds > 1 the
    whole sequence repeats and each point reports its round of median req/s.
    """
    started = time.monotonic()
    folder = tempfile.mkdtemp(prefix="mr-dataplane-")
    figures: dict = {
        "duration_s": duration,
        "warmup_s": warmup,
        "rounds": rounds,
        "points": [],
        "notes": [],
        "peer": peer,
        "runtime_env": dict(RUNTIME_ENV),
    }
    failed: dict[tuple[str, str], str] = {}  # (case, payload) -> why it has no figures
    targets_: list[Target] = []

    def cannot(rows: tuple[tuple[str, str], ...], error: BaseException) -> None:
        traceback.print_exc()
        for row in rows:
            if row not in failed and not any((t.case, t.payload) == row for t in targets_):
                failed[row] = repr(error)[:200]
                print(f"ERROR {row[0]} {row[1]}: {error!r}", file=sys.stderr)

    figures["h2load"] = ensure_h2load()
    figures["load_average_before"] = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        # (a) the ceiling of a Python front: one canned server per payload
        for payload, big in ((SMALL, False), (BIG, True)):
            try:
                canned = stack.enter_context(
                    Canned(folder, "big" if big else "small", echo_response("echo", big))
                )
                targets_.append(
                    Target(
                        CASE_A,
                        payload,
                        canned.port,
                        big_request("echo") if big else small_request("echo"),
                        mesh_header_lines("echo"),
                        expect_anything,
                        canned.processes,
                        folder,
                    )
                )
            except Exception as error:
                cannot(((CASE_A, payload),), error)
        # (a') the same on uvloop, the event loop mesh-runtime's front runs on (a reference)
        try:
            canned = stack.enter_context(Canned(folder, "uvloop", echo_response("echo", False), uvloop=True))
            targets_.append(
                Target(
                    CASE_A_UVLOOP,
                    SMALL,
                    canned.port,
                    small_request("echo"),
                    mesh_header_lines("echo"),
                    expect_anything,
                    canned.processes,
                    folder,
                )
            )
        except Exception as error:
            cannot(((CASE_A_UVLOOP, SMALL),), error)
        # (a2) behind one ZeroMQ hop, on uvloop as mesh-runtime's front
        try:
            hop = stack.enter_context(
                Canned(folder, "hop", echo_response("echo", False), hop=True, uvloop=True)
            )
            targets_.append(
                Target(
                    CASE_A2,
                    SMALL,
                    hop.port,
                    small_request("echo"),
                    mesh_header_lines("echo"),
                    expect_anything,
                    hop.processes,
                    folder,
                )
            )
        except Exception as error:
            cannot(((CASE_A2, SMALL),), error)

        # (b) and (c): one runtime with its defaults, serving echo and iris
        rt = harness.Runtime(preload_frameworks=True, **RUNTIME_ENV)
        stack.callback(stop_runtime, rt)
        try:
            progress("starting mesh-runtime, loading echo and iris")
            rt.start()
            rt.load("echo", rt.model_dir("echo"))
            runtime_tree = lambda: harness.tree(rt.pid)  # noqa: E731
            for payload, big in ((SMALL, False), (BIG, True)):
                targets_.append(
                    Target(
                        CASE_B,
                        payload,
                        rt.port,
                        big_request("echo") if big else small_request("echo"),
                        mesh_header_lines("echo"),
                        expect_echo(big),
                        runtime_tree,
                        folder,
                    )
                )
            figures["iris_served_as"] = load_iris_model(rt)
            targets_.append(
                Target(
                    CASE_C,
                    SMALL,
                    rt.port,
                    small_request("iris"),
                    mesh_header_lines("iris"),
                    expect_iris,
                    runtime_tree,
                    folder,
                    note=figures["iris_served_as"],
                )
            )
        except Exception as error:
            cannot(((CASE_B, SMALL), (CASE_B, BIG), (CASE_C, SMALL)), error)
            if rt.process is not None:
                print(f"runtime log ({rt.log_path}), its end:\n{rt.log()[-3000:]}", file=sys.stderr)

        # (b') the same echo, busy polling
        polling = harness.Runtime(preload_frameworks=True, **RUNTIME_ENV, **POLLING_ENV)
        stack.callback(stop_runtime, polling)
        try:
            progress("starting mesh-runtime with busy polling, loading echo")
            polling.start()
            polling.load("echo", polling.model_dir("echo"))
            targets_.append(
                Target(
                    CASE_B_POLLING,
                    SMALL,
                    polling.port,
                    small_request("echo"),
                    mesh_header_lines("echo"),
                    expect_echo(False),
                    lambda: harness.tree(polling.pid),
                    folder,
                    note=" ".join(f"{k}={v}" for k, v in POLLING_ENV.items()),
                )
            )
        except Exception as error:
            cannot(((CASE_B_POLLING, SMALL),), error)

        # (d) the peer
        if peer == "mlserver":
            try:
                iris = os.path.join(folder, "iris.joblib")
                train_iris(iris)
                server = MLServer(folder, iris)
                python = os.path.join(MLSERVER_VENV, "bin", "python")
                figures["notes"].append(
                    f"peer: MLServer {package_version(python, 'mlserver')}, mlserver-sklearn "
                    f"{package_version(python, 'mlserver-sklearn')}, scikit-learn "
                    f"{package_version(python, 'scikit-learn')} "
                    f"(ours {package_version(sys.executable, 'scikit-learn')}); "
                    "settings.json: parallel_workers 0, ports; the rest default; 1 MiB: an echo MLModel"
                )
                progress("starting MLServer")
                stack.enter_context(server)
                targets_.append(
                    Target(
                        CASE_D_SKLEARN,
                        SMALL,
                        server.port,
                        small_request("iris"),
                        [],
                        expect_iris,
                        server.processes,
                        folder,
                    )
                )
                targets_.append(
                    Target(
                        CASE_D_ECHO,
                        BIG,
                        server.port,
                        big_request("echo"),
                        [],
                        expect_echo(True),
                        server.processes,
                        folder,
                        note="custom MLModel returning its inputs",
                    )
                )
            except Exception as error:
                cannot(((CASE_D_SKLEARN, SMALL), (CASE_D_ECHO, BIG)), error)

        figures["seconds_setup"] = time.monotonic() - started
        results: dict[tuple[str, str, int], list[dict]] = {}
        for round_ in range(rounds):
            for payload in (SMALL, BIG):
                for c in CONCURRENCY:
                    for target in targets_:
                        if target.payload != payload:
                            continue
                        progress(
                            f"{target.case} {payload} c={c}"
                            + (f" (round {round_ + 1})" if rounds > 1 else "")
                        )
                        try:
                            result = measure(target, c, duration, warmup, folder)
                        except Exception as error:
                            message = str(error) if isinstance(error, CheckFailed) else repr(error)
                            print(f"ERROR {target.case} {payload} c={c}: {message}", file=sys.stderr)
                            if not isinstance(error, CheckFailed):
                                traceback.print_exc()
                            result = {"error": message}
                        results.setdefault((target.case, payload, c), []).append(result)

    for case, payload in ROWS:
        if case.startswith("(d)") and peer is None:
            continue
        for c in CONCURRENCY:
            key = {"case": case, "payload": payload, "concurrency": c}
            runs = results.get((case, payload, c))
            if runs is None:
                figures["points"].append({**key, "error": failed.get((case, payload), "not measured")})
            elif any("error" in r for r in runs):
                figures["points"].append({**key, "error": next(r["error"] for r in runs if "error" in r)})
            else:
                chosen = sorted(runs, key=lambda r: r["req_s"])[len(runs) // 2]
                figures["points"].append({**chosen, **key, "rounds_req_s": [r["req_s"] for r in runs]})
    ok = not any("error" in p for p in figures["points"])
    figures["seconds"] = time.monotonic() - started
    if ok:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"data-plane files kept: {folder}", file=sys.stderr)
    figures["targets"] = targets(figures["points"], peer)
    figures["per_call_targets"] = per_call_targets(figures["points"])
    return figures, ok


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--peer",
        choices=["mlserver"],
        help="also measure MLServer 1.7.1 (installs it into .bench/mlserver-venv on first use)",
    )
    parser.add_argument("--duration", type=float, default=8.0, help="seconds measured per point (default 8)")
    parser.add_argument(
        "--warmup", type=float, default=1.0, help="seconds of warm-up run per point (default 1)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the interleaved sequence; each point reports its median round (default 1)",
    )


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args()
    try:
        figures, ok = run(args.duration, args.warmup, args.peer, args.rounds)
    except Exception:
        traceback.print_exc()
        return 1
    print_dataplane(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
        print(f"\nfigures written to {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
