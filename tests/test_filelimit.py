"""The front raises its open-file soft limit to the hard one, and warns, naming WORKERS_MAX, when even
that cannot hold the workers it may be asked for.

Unit tests of runtime/filelimit.py, then real fronts (tests/harness.Runtime)
started under a lowered hard limit.
"""

import logging
import resource
import sys

import grpc
import psutil
import pytest
from harness import MiB, Runtime

from runtime import filelimit
from runtime.settings import Settings

# Sets the open-file limits, then becomes the command after it (the runtime keeps the pid).
SOFT, HARD = 256, 512
WITH_LOWER_LIMITS = (
    sys.executable,
    "-c",
    "import os, resource, sys; "
    f"resource.setrlimit(resource.RLIMIT_NOFILE, ({SOFT}, {HARD})); "
    "os.execv(sys.argv[1], sys.argv[1:])",
)


@pytest.fixture
def own_limits():
    """This process's open-file limits, put back after the test."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    yield limits
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)


# -- arithmetic -----------------------------------------------------------------


def test_a_limit_holds_what_is_left_after_the_base_in_whole_workers():
    base, each = filelimit.BASE_DESCRIPTORS, filelimit.DESCRIPTORS_PER_WORKER
    assert filelimit.workers_held(base + 10 * each) == 10
    assert filelimit.workers_held(base + 10 * each + each - 1) == 10
    assert filelimit.workers_held(base - 1) == 0


def test_the_workers_wanted_are_workers_max_else_what_the_memory_could_hold():
    floor = filelimit.WORKER_MEMORY_FLOOR_BYTES
    assert filelimit.workers_wanted(7, 1000 * floor) == 7
    assert filelimit.workers_wanted(0, 1000 * floor) == 1000


def test_no_warning_while_the_limit_holds_every_worker():
    limit = filelimit.BASE_DESCRIPTORS + 20 * filelimit.DESCRIPTORS_PER_WORKER
    assert filelimit.shortfall_warning(limit, 20, 2**40) is None
    assert filelimit.shortfall_warning(limit, 0, 20 * filelimit.WORKER_MEMORY_FLOOR_BYTES) is None


def test_the_warning_names_the_limit_what_it_holds_and_workers_max():
    limit = filelimit.BASE_DESCRIPTORS + 20 * filelimit.DESCRIPTORS_PER_WORKER
    warning = filelimit.shortfall_warning(limit, 21, 2**40)
    assert warning is not None
    assert f"open-file limit ({limit}) holds about 20 workers" in warning
    assert "WORKERS_MAX=21 allows 21" in warning
    assert "set WORKERS_MAX to 20 or less" in warning
    assert "ulimit -n" in warning


def test_with_no_cap_the_warning_names_the_memory_and_workers_max():
    limit = filelimit.BASE_DESCRIPTORS + 20 * filelimit.DESCRIPTORS_PER_WORKER
    memory = 21 * filelimit.WORKER_MEMORY_FLOOR_BYTES
    warning = filelimit.shortfall_warning(limit, 0, memory)
    assert warning is not None
    assert f"WORKERS_MAX=0 (no cap) lets the container's {memory // MiB} MiB hold up to 21" in warning
    assert "set WORKERS_MAX to 20 or less" in warning


def test_a_limit_that_holds_no_worker_does_not_advise_workers_max_0():
    warning = filelimit.shortfall_warning(filelimit.BASE_DESCRIPTORS, 4, 2**40)
    assert warning is not None
    assert "set WORKERS_MAX" not in warning and "raise the hard limit" in warning


# -- the limit itself ---------------------------------------------------------------


def test_an_unlimited_hard_limit_stands_for_the_kernels_nr_open(tmp_path, monkeypatch):
    nr_open = tmp_path / "nr_open"
    nr_open.write_text("4096\n")
    monkeypatch.setattr(filelimit, "NR_OPEN_PATH", str(nr_open))
    assert filelimit.finite_limit(resource.RLIM_INFINITY) == 4096
    assert filelimit.finite_limit(1000) == 1000
    monkeypatch.setattr(filelimit, "NR_OPEN_PATH", str(tmp_path / "missing"))
    assert filelimit.finite_limit(resource.RLIM_INFINITY) == filelimit.DEFAULT_NR_OPEN


def test_the_soft_limit_is_raised_to_the_hard_one_and_both_are_logged(own_limits, caplog):
    _, hard = own_limits
    lowered = min(SOFT, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    with caplog.at_level(logging.INFO, logger="mesh.filelimit"):
        now = filelimit.raise_soft_limit()
    assert resource.getrlimit(resource.RLIMIT_NOFILE) == (now, hard)
    assert now == filelimit.finite_limit(hard)
    assert f"was {lowered}, now {now}" in caplog.text


def test_the_check_warns_once_when_workers_max_asks_for_more_than_any_limit_holds(own_limits, caplog):
    # No kernel lets a process open three billion files (nr_open is at most about a billion).
    settings = Settings.from_env({"WORKERS_MAX": str(10**9)})
    with caplog.at_level(logging.INFO, logger="mesh.filelimit"):
        filelimit.check_open_file_limit(settings)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and f"WORKERS_MAX={10**9}" in warnings[0]


# -- a real front ----------------------------------------------------------------------


def front_limits(rt: Runtime) -> tuple[int, int]:
    return psutil.Process(rt.pid).rlimit(psutil.RLIMIT_NOFILE)


def test_the_front_runs_at_its_hard_limit_and_warns_when_workers_max_asks_for_more():
    held = filelimit.workers_held(HARD)
    with Runtime(command_prefix=WITH_LOWER_LIMITS, WORKERS_MAX="1000") as rt:
        assert front_limits(rt) == (HARD, HARD)
        assert f"open-file soft limit: was {SOFT}, now {HARD}" in rt.log()
        warnings = [line for line in rt.log().splitlines() if "open-file limit (" in line]
        assert len(warnings) == 1, rt.log()
        warning = warnings[0]
        assert "WARNING" in warning
        assert f"holds about {held} workers, but WORKERS_MAX=1000 allows 1000" in warning
        assert f"set WORKERS_MAX to {held} or less" in warning


def test_the_front_does_not_warn_when_workers_max_fits_the_limit():
    with Runtime(command_prefix=WITH_LOWER_LIMITS, WORKERS_MAX="4") as rt:
        assert front_limits(rt) == (HARD, HARD)
        assert "open-file soft limit" in rt.log()
        assert "WORKERS_MAX" not in rt.log()


def limited_to(descriptors: int) -> tuple[str, ...]:
    """WITH_LOWER_LIMITS with both limits at `descriptors`."""
    setter = f"resource.setrlimit(resource.RLIMIT_NOFILE, ({descriptors}, {descriptors}))"
    return (sys.executable, "-c", f"import os, resource, sys; {setter}; os.execv(sys.argv[1], sys.argv[1:])")


def forkserver_pid(rt: Runtime) -> int:
    return next(p.pid for p in psutil.Process(rt.pid).children() if p.children())


@pytest.mark.slow  # loads models until the limit refuses one
def test_a_load_past_the_limit_is_refused_and_takes_nothing_down():
    with Runtime(command_prefix=limited_to(120)) as rt:
        forkserver = forkserver_pid(rt)
        loaded, refused = [], None
        for i in range(40):
            try:
                rt.load(f"m{i}", rt.model_dir(f"m{i}"))
                loaded.append(f"m{i}")
            except grpc.RpcError as error:
                refused = error
                break
        assert refused is not None, "40 workers fitted in 120 descriptors"
        assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert "open-file limit" in refused.details()
        assert len(loaded) >= 3
        assert forkserver_pid(rt) == forkserver
        assert all(rt.infer_fp32(m, [1.0]).outputs for m in loaded)
        assert "healing" not in rt.log(), "a worker died on the way"
        rt.unload(loaded[0])  # frees a worker's descriptors: the next load fits again
        rt.load("after", rt.model_dir("after"))


def test_descriptors_are_counted_only_once_the_limit_is_near(own_limits, monkeypatch):
    counted = []
    monkeypatch.setattr(filelimit, "open_descriptors", lambda: counted.append(1) or 100)
    resource.setrlimit(resource.RLIMIT_NOFILE, (10_000, own_limits[1]))
    assert filelimit.room_for_a_worker(10) and not counted  # far from the limit: no count
    assert filelimit.room_for_a_worker(2_000) and counted  # within a factor of two: counted
    # Near the limit, the count decides: 100 open + 4 for the worker + 32 kept free.
    resource.setrlimit(resource.RLIMIT_NOFILE, (135, own_limits[1]))
    assert not filelimit.room_for_a_worker(0)
    resource.setrlimit(resource.RLIMIT_NOFILE, (136, own_limits[1]))
    assert filelimit.room_for_a_worker(0)


def test_workers_on_their_way_count_as_if_their_descriptors_were_open(own_limits, monkeypatch):
    # Starts of several fork servers run at once: one not yet forked has opened nothing.
    monkeypatch.setattr(filelimit, "open_descriptors", lambda: 100)
    resource.setrlimit(resource.RLIMIT_NOFILE, (144, own_limits[1]))
    assert filelimit.room_for_a_worker(2, starting=2)  # 100 + 3 x 4 + 32
    assert not filelimit.room_for_a_worker(3, starting=3)
