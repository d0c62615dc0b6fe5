"""Reading /proc about processes that exit under us: runtime/memory.py, memory.uss_each, the admin commands.

The contract: memory.uss, resident, kernel_share and cost raise psutil.NoSuchProcess for a
process that is gone (exiting, a zombie, reaped) and psutil.AccessDenied for
one that is not ours; everything built on them answers 0 (or skips it).
"""

from __future__ import annotations

import asyncio
import collections
import errno
import io
import os
import signal
import subprocess
import threading
import time
import types

import psutil
import pytest

from runtime import memory
from runtime.admin import AdminError, kill, stacks
from runtime.admin import workers as admin_workers

ME = os.getpid()
# Above the largest pid_max Linux allows: never a process, so signalling it fails with ESRCH.
NO_SUCH_PID = 2**22 + 1
ROUNDS = 60  # children killed under the readers, one by one


def sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "30"])


def reaped_pid() -> int:
    child = sleeper()
    child.kill()
    child.wait()
    return child.pid


def zombie() -> subprocess.Popen:
    """A child killed and not yet waited for."""
    child = sleeper()
    child.kill()
    deadline = time.monotonic() + 5
    while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the child did not become a zombie"
        time.sleep(0.005)
    return child


# -- (a) real processes dying while we read them ------------------------------------------


def _read_everything(pid: int, outcomes: dict) -> None:
    """Every reader on `pid` (and on our own tree); only psutil.Error may come out of the readers."""
    for reader in READERS:
        try:
            assert reader(pid) >= 0
            outcomes["read"] += 1
        except psutil.Error as error:
            outcomes[type(error).__name__] += 1
    assert memory.cost_or_zero(pid) >= 0
    assert all(size >= 0 for size in memory.uss_each([pid, None]))
    assert all(size >= 0 for size in memory.serving_costs([(pid, 0), (None, 0)]))
    assert memory.overhead(set()) > 0


@pytest.mark.slow  # starts and kills a hundred processes or more
def test_readers_survive_processes_killed_under_them():
    outcomes = collections.Counter()
    stop = threading.Event()
    killed_in_background: list[int] = []

    def churn() -> None:  # children of ours that die while overhead() walks our tree
        while not stop.is_set():
            child = sleeper()
            killed_in_background.append(child.pid)
            child.kill()
            child.wait()

    background = threading.Thread(target=churn)
    background.start()
    try:
        for _ in range(ROUNDS):
            child = sleeper()
            _read_everything(child.pid, outcomes)  # alive (maybe still exec'ing)
            os.kill(child.pid, signal.SIGKILL)
            _read_everything(child.pid, outcomes)  # exiting or a zombie
            child.wait()
            _read_everything(child.pid, outcomes)  # reaped
            if killed_in_background:
                _read_everything(killed_in_background[-1], outcomes)
    finally:
        stop.set()
        background.join()
    # every reader of each reaped child at least; and some reads of live ones.
    assert outcomes["read"] > 0 and outcomes["NoSuchProcess"] >= 2 * ROUNDS, outcomes
    assert len(killed_in_background) > 10


# -- (b) each errno the kernel may answer, one at a time ----------------------------------

GONE_ERRORS = [
    ProcessLookupError(errno.ESRCH, "No such process"),
    FileNotFoundError(errno.ENOENT, "No such file or directory"),
]
ALL_ERRORS = [*GONE_ERRORS, PermissionError(errno.EACCES, "Permission denied")]
EXPECTED = {
    ProcessLookupError: psutil.NoSuchProcess,
    FileNotFoundError: psutil.NoSuchProcess,
    PermissionError: psutil.AccessDenied,
}
ROOT_ROLLUP = b"Rss: 400 kB\nPss: 100 kB\nPrivate_Clean: 10 kB\nPrivate_Dirty: 20 kB\n"
READERS = (
    memory.uss,
    memory.resident,
    memory.proportional,
    memory.kernel_share,
    memory.cost,
    memory.tree_cost,
)


@pytest.fixture
def rollup_fails(monkeypatch):
    """Makes every /proc/PID file raise `error` for every pid but ours, whose rollup reads ROOT_ROLLUP."""

    def install(error: OSError):
        def fake_open(path, *args, **kwargs):
            if isinstance(path, str) and path.startswith("/proc/") and not path.startswith("/proc/self"):
                if path == f"/proc/{ME}/smaps_rollup":
                    return io.BytesIO(ROOT_ROLLUP)
                if not path.startswith(f"/proc/{ME}/"):
                    raise error
            return open(path, *args, **kwargs)

        monkeypatch.setattr(memory, "open", fake_open, raising=False)
        # With smaps_rollup present, psutil must never be asked instead.
        monkeypatch.setattr(
            psutil.Process, "memory_full_info", lambda self: pytest.fail("psutil fallback used")
        )

    return install


@pytest.fixture
def child():
    process = sleeper()
    yield process
    process.kill()
    process.wait()


@pytest.mark.parametrize("error", ALL_ERRORS, ids=lambda e: type(e).__name__)
def test_every_reader_raises_psutil_errors(rollup_fails, child, error):
    rollup_fails(error)
    for reader in READERS:
        with pytest.raises(EXPECTED[type(error)]) as caught:
            reader(child.pid)
        assert caught.value.pid == child.pid
    assert memory.uss(ME) == 30 * 1024 and memory.resident(ME) == 400 * 1024
    assert memory.cost(ME) == 30 * 1024 + memory.kernel_share(ME)


@pytest.mark.parametrize("error", ALL_ERRORS, ids=lambda e: type(e).__name__)
def test_costs_and_sizes_answer_zero(rollup_fails, child, error):
    rollup_fails(error)
    assert memory.cost_or_zero(child.pid) == 0
    assert memory.uss_each([child.pid, ME, None]) == [0, 30 * 1024, 0]
    assert memory.serving_costs([(child.pid, 1), (None, 1)]) == [0, 0]


@pytest.mark.parametrize("error", ALL_ERRORS, ids=lambda e: type(e).__name__)
def test_overhead_skips_descendants_it_cannot_read(rollup_fails, child, error):
    rollup_fails(error)
    assert child.pid in {p.pid for p in psutil.Process(ME).children(recursive=True)}
    assert memory.overhead(set()) == memory.cost(ME)


def test_real_zombie_and_reaped_process():
    child = zombie()
    try:
        with pytest.raises(psutil.NoSuchProcess):
            memory.uss(child.pid)
        with pytest.raises(psutil.NoSuchProcess):
            memory.kernel_share(child.pid)
        assert memory.uss_each([child.pid]) == [0]
    finally:
        child.wait()
    with pytest.raises(psutil.NoSuchProcess):
        memory.uss(child.pid)
    assert memory.uss_each([child.pid]) == [0]


def test_psutil_fallback_without_smaps_rollup(monkeypatch, child):
    monkeypatch.setattr(memory, "_HAS_ROLLUP", False)
    assert memory.uss(child.pid) > 0 and memory.resident(child.pid) > 0
    gone = reaped_pid()
    with pytest.raises(psutil.NoSuchProcess):
        memory.uss(gone)
    assert memory.cost_or_zero(gone) == 0


# -- (c) the admin commands -----------------------------------------------------------------


def test_workers_measure_of_vanished_pids():
    admin_workers._processes.clear()
    child = sleeper()
    figures = admin_workers._measure([child.pid])
    assert figures[child.pid][0] > 0 and child.pid in admin_workers._processes
    child.kill()
    child.wait()
    gone, zombie_child = child.pid, zombie()
    try:
        figures = admin_workers._measure([gone, zombie_child.pid])
    finally:
        zombie_child.wait()
    assert figures == {gone: (0, 0, 0.0), zombie_child.pid: (0, 0, 0.0)}
    assert gone not in admin_workers._processes


def test_stacks_of_a_worker_reaped_meanwhile(tmp_path):
    dead = types.SimpleNamespace(pid=reaped_pid(), alive=False, signal=lambda signum: None)
    with pytest.raises(AdminError, match=f"worker {dead.pid} has ended"):
        asyncio.run(stacks._dump(dead, str(tmp_path / str(dead.pid))))
    assert not os.path.exists(tmp_path / str(dead.pid)), "a stacks file was left for a dead worker"


def test_stacks_file_deleted_while_waiting(tmp_path):
    path = tmp_path / "1234"
    path.write_text("")

    def reaped(signum):  # the worker dies on the signal and the pool deletes its file
        dying.alive = False
        os.unlink(path)

    dying = types.SimpleNamespace(pid=1234, alive=True, signal=reaped)
    with pytest.raises(AdminError, match="worker 1234 has ended"):
        asyncio.run(stacks._dump(dying, str(path)))


def test_kill_a_worker_whose_process_is_gone():
    from runtime.pool import WorkerPool
    from runtime.worker import KillCause, Worker

    async def scenario():
        target = Worker(b"w-1", process=None)
        target.pid = NO_SUCH_PID  # as if it had ended and not yet been reaped
        pool = types.SimpleNamespace(workers=lambda: [target])
        pool.kill = lambda *args: WorkerPool.kill(pool, *args)  # the pool's own kill, without a pool
        return target, await kill.run(types.SimpleNamespace(pool=pool), [str(target.pid)])

    target, killed = asyncio.run(scenario())
    assert killed == [target.pid] and target.kill_cause is KillCause.OPERATOR


def test_a_worker_that_has_not_served_is_charged_its_first_calls(monkeypatch):
    monkeypatch.setattr(memory, "tree_cost_or_zero", lambda pid: 0 if pid is None else 5 * 1024 * 1024)
    first, served, gone = memory.serving_costs([(1, 384 * 1024), (1, 0), (None, 384 * 1024)])
    assert served == 5 * 1024 * 1024 + memory.FRONT_SHARE_BYTES
    assert first == served + 384 * 1024
    assert gone == 0  # nothing charged for a process that is not there
