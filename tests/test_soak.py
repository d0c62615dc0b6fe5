"""Soak: 1,000 load/infer/unload cycles beside steady traffic; the front must stay flat."""

import threading
import time

import psutil
import pytest
from harness import MiB, Runtime, alive, tree, wait_until

CYCLES = 1000


def front_figures(runtime):
    front = psutil.Process(runtime.pid)
    wait_until(
        lambda: len(alive(runtime.spares())) == 1 and runtime.model_workers() == 1,
        timeout=15,
        what="the pool to settle",
    )
    return {
        "rss_mib": front.memory_info().rss / MiB,
        "fds": front.num_fds(),
        "threads": front.num_threads(),
        "processes": len(alive(tree(runtime.pid))),
    }


@pytest.mark.slow
def test_thousand_cycles_keep_the_front_flat():
    with Runtime(WORKERS_WARM="1") as runtime:
        runtime.load("steady", runtime.model_dir("steady"))
        churn_path = runtime.model_dir("churn")
        failures, served, stop = [], [0], threading.Event()

        def steady_traffic():
            while not stop.is_set():
                try:
                    runtime.infer_fp32("steady", [1.0, 2.0])
                    served[0] += 1
                except Exception as error:  # any failure of the steady model is a finding
                    failures.append(repr(error))

        def cycle(n):
            runtime.load("churn", churn_path)
            runtime.infer_fp32("churn", [float(n)])
            runtime.unload("churn")

        traffic = threading.Thread(target=steady_traffic)
        traffic.start()
        try:
            for n in range(50):  # warm-up: executors, arenas and caches reach their size
                cycle(n)
            before = front_figures(runtime)
            started = time.monotonic()
            for n in range(CYCLES):
                cycle(n)
            seconds = time.monotonic() - started
            after = front_figures(runtime)
        finally:
            stop.set()
            traffic.join(30)
        print(f"\nsoak: {CYCLES} cycles in {seconds:.1f} s, {served[0]} steady calls, {len(failures)} failed")
        for key in before:
            print(f"soak: front {key:10s} before {before[key]:8.1f}  after {after[key]:8.1f}")
        assert not failures, failures[:5]
        assert after["rss_mib"] - before["rss_mib"] < 16
        assert abs(after["fds"] - before["fds"]) <= 2
        assert abs(after["threads"] - before["threads"]) <= 2
        assert after["processes"] == before["processes"]
