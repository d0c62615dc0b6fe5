"""Workers that die before they say hello are forked again only after a growing pause."""

from __future__ import annotations

import datetime
import os
import time

import grpc
from harness import REPO, Runtime, expect_status, status_of, wait_until

from protos import model_runtime_pb2 as mm

OK = grpc.StatusCode.OK


def logged_at(log: str, text: str) -> float:
    """When the first log line holding `text` was written (its asctime, in seconds)."""
    line = next(line for line in log.splitlines() if text in line)
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def test_workers_that_die_at_start_are_forked_again_only_after_a_growing_pause_and_sigterm_still_stops_it():
    meshtest = os.path.join(REPO, "meshtest")
    rt = Runtime(WORKER_PRELOAD="numpy,die_at_fork", PYTHONPATH=meshtest, WORKERS_WARM="1")
    rt.start(wait_ready=False)
    try:
        # Pauses of 1, 2 and 4 s: the third failed start comes 3 s after the first, not hundreds.
        wait_until(lambda: "3 workers in a row" in rt.log(), timeout=30, what="the third failed start")
        rt.terminate()  # in the 4 s pause; SIGKILL after 30 s if it does not act on SIGTERM
        log = rt.log()
    finally:
        rt.stop()
    failures = log.count("workers in a row did not start")
    assert 2 <= failures <= 4, log[-2000:]
    assert "1 workers in a row did not start; the next in 1 s" in log
    assert "2 workers in a row did not start; the next in 2 s" in log
    assert "3 workers in a row did not start; the next in 4 s" in log
    # Each pause was waited out: the failures' log lines lie at least 1 s, then 2 s, apart.
    first, second, third = (logged_at(log, f"{n} workers in a row did not start") for n in (1, 2, 3))
    assert second - first >= 0.99 and third - second >= 1.99, (first, second, third)
    # SIGTERM stopped it although its pool was never ready.
    assert rt.process is not None and rt.process.returncode == 0, log[-2000:]
    assert "stopped before the worker pool was ready" in log
    assert "stopped; every worker reaped" in log


def test_a_load_waiting_for_a_worker_that_never_starts_gets_unavailable_after_three_failed_starts():
    meshtest = os.path.join(REPO, "meshtest")
    rt = Runtime(WORKER_PRELOAD="numpy,die_at_fork", PYTHONPATH=meshtest, LOADTIME_TIMEOUT="60000")
    rt.start(wait_ready=False)
    try:
        wait_until(lambda: status_of(rt.mesh.runtimeStatus, mm.RuntimeStatusRequest(), timeout=5) == OK)
        started = time.monotonic()
        error = expect_status(grpc.StatusCode.UNAVAILABLE, rt.load, "m", rt.model_dir("echo"), timeout=30)
        # Starts failed at 0, 1 and 3 s: the load ends at the third, not at LOADTIME_TIMEOUT.
        assert time.monotonic() - started < 10
        assert "workers of the base fork server in a row did not start" in error.details()
        log = rt.log()
    finally:
        rt.stop()
    assert "load of m failed: 3 workers of the base fork server in a row did not start" in log, log[-2000:]
