"""Workers that die before they say hello are forked again only after a growing pause."""

from __future__ import annotations

import os
import time

from harness import REPO, Runtime


def test_workers_that_die_at_start_are_forked_again_only_after_a_growing_pause_and_sigterm_still_stops_it():
    meshtest = os.path.join(REPO, "meshtest")
    rt = Runtime(WORKER_PRELOAD="numpy,die_at_fork", PYTHONPATH=meshtest, WORKERS_WARM="1")
    rt.start(wait_ready=False)
    try:
        time.sleep(6)  # pauses of 1, 2 and 4 s: three failed starts, not hundreds
        rt.terminate()  # SIGKILL after 30 s if it does not act on SIGTERM
        log = rt.log()
    finally:
        rt.stop()
    failures = log.count("workers in a row did not start")
    assert 2 <= failures <= 4, log[-2000:]
    assert "1 workers in a row did not start; the next in 1 s" in log
    assert "2 workers in a row did not start; the next in 2 s" in log
    # SIGTERM stopped it although its pool was never ready.
    assert rt.process is not None and rt.process.returncode == 0, log[-2000:]
    assert "stopped before the worker pool was ready" in log
    assert "stopped; every worker reaped" in log
