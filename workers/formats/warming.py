"""What the fork server does for the formats before it forks any worker.

A worker pays at its first load and its first call for whatever its
framework initialises lazily: submodules imported by an unpickle, caches
filled by a first predict, an interpreter set up by a first run. Paid in
the fork server instead, it is paid once and its memory is shared by every
worker, where each worker would otherwise keep its own private copy. So each
format module may define `warm()`, which the fork server calls once for each
framework it imported (workers/preload.py).

A fork copies only the thread that calls it: a framework thread pool started
in the fork server is missing from every worker and hangs the first call
that waits for it. So `warm()` starts no thread: it never creates an
onnxruntime session, runs a tensor op in torch or predicts with xgboost, and
tests/test_warming.py counts the fork server's threads around it.

Nothing here imports a framework or numpy: `limit_thread_pools()` must run
before they are imported.
"""

from __future__ import annotations

import importlib
import os
import signal
import sys
import time

from plumbing import lifeline
from workers import formats

# Read by OpenMP (xgboost, lightgbm, torch, scikit-learn), OpenBLAS (numpy,
# scipy) and MKL when they are loaded.
THREAD_POOL_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def limit_thread_pools() -> None:
    """Sizes the frameworks' thread pools to WORKER_THREADS, unless the environment already does.

    A pool sized to every core is started again in each worker after its fork
    (its first call pays for it), spins between calls on the cores the other
    workers need, and gives each thread a stack and a malloc arena of its own.
    """
    threads = str(formats.worker_threads())
    for name in THREAD_POOL_VARIABLES:
        os.environ.setdefault(name, threads)


def openmp_is_single_threaded() -> bool:
    """True when OpenMP runs no thread of its own: then an OpenMP loop is safe before a fork."""
    return os.environ.get("OMP_NUM_THREADS") == "1"


def warm_imported() -> None:
    """Runs warm() of each format whose framework is imported; a failure is reported, never raised."""
    for fmt in _imported_formats():
        _warm(fmt)


def _imported_formats() -> list[formats.Format]:
    return [f for f in formats.FORMATS if f.framework is None or f.framework in sys.modules]


def _hook(fmt: formats.Format, name: str):
    """The format module's optional function `name`, or None."""
    return getattr(importlib.import_module(fmt.module), name, None)


def _warm(fmt: formats.Format) -> None:
    threads = _thread_count()
    try:
        warm = _hook(fmt, "warm")
        if warm is not None:
            warm()
    except Exception as error:  # a broken framework must not stop the fork server
        _report(f"cannot warm {fmt.name}: {type(error).__name__}: {error}")
    if _thread_count() > threads:
        _report(f"warming {fmt.name} started a thread; workers may hang on their first call")


def _thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def _report(message: str) -> None:
    # As workers/preload.py reports a failed import: on stderr, which the fork server shares with the front.
    print(f"mesh-runtime forkserver: {message}", file=sys.stderr)


# A child that runs the frameworks' first tensor ops is killed if it has not exited by then.
TOUCH_CHILD_SECONDS = 30.0


def touch_compute_code_in_a_child() -> bool:
    """Runs each imported format's `touch_compute_code()` in a throwaway child, and reaps it.

    A framework's first tensor op runs kernels that no import touched, and the
    kernel reads their code from disk into the page cache, charging it to the
    memory cgroup of the process that faults it in first. Left to the first
    worker that serves a model, that charge comes after the runtime's own cost
    was counted and lands in no model's size. A child of the fork server pays
    it at start instead, into the runtime's own cost; it may start thread pools,
    as it exits before the fork server forks any worker. False if it failed or hung.
    """
    touches = _touches_of_imported_formats()
    if not touches:
        return True
    forkserver = os.getpid()
    child = os.fork()
    if child == 0:
        _run_touches_and_exit(touches, forkserver)
    return _reap_within(child, TOUCH_CHILD_SECONDS)


def _touches_of_imported_formats() -> list:
    touches = []
    for fmt in _imported_formats():
        try:
            touch = _hook(fmt, "touch_compute_code")
        except Exception as error:  # reported already by the preload's import; nothing to run
            _report(f"cannot import {fmt.module}: {type(error).__name__}: {error}")
            continue
        if touch is not None:
            touches.append((fmt.name, touch))
    return touches


def _run_touches_and_exit(touches: list, forkserver: int) -> None:
    status = 0
    try:
        lifeline.die_with_parent(expected_parent=forkserver)
        for name, touch in touches:
            try:
                touch()
            except Exception as error:
                _report(f"cannot run {name}'s first tensor ops at start: {type(error).__name__}: {error}")
                status = 1
    finally:
        os._exit(status)  # no atexit handler, no flush of the fork server's buffers


def _reap_within(child: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid == child:
            return os.waitstatus_to_exitcode(status) == 0
        time.sleep(0.005)
    os.kill(child, signal.SIGKILL)
    os.waitpid(child, 0)
    _report(f"the child running the first tensor ops took over {seconds:g} s; killed")
    return False
