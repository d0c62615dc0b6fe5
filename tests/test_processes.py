"""Processes we start, we reap: no orphans after SIGTERM or SIGKILL, no leftovers across restarts."""

import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from harness import Runtime, alive, expect_status, tree, wait_until
from test_runtime_dir import record, start_titled

from plumbing import lifeline, priority, titles
from runtime import forkserver, server
from runtime.worker import KillCause, Worker

# Packs of 4 under a limit that the helpers' memory stays under: what moves a model with helpers out of
# its pack, to a worker of its own, is then its processes, not its size.
HELPERS_FIT = {"MODELS_PER_WORKER": "4", "MODEL_PACK_MAX_BYTES": str(64 * 2**20)}


def test_sigterm_reaps_every_process_and_removes_runtime_dir():
    runtime = Runtime().start()
    runtime.load("m", runtime.model_dir("m"))
    processes = tree(runtime.pid)
    assert len(processes) >= 4  # front, fork server, resource tracker, model worker, spare
    runtime.process.send_signal(signal.SIGTERM)
    assert runtime.process.wait(15) == 0
    assert not alive(processes)
    assert not os.path.exists(runtime.env["RUNTIME_DIR"])
    runtime.stop()


def test_sigkill_of_the_front_leaves_no_process_within_10_s():
    runtime = Runtime(WORKERS_WARM="2").start()
    runtime.load("m", runtime.model_dir("m"))
    processes = tree(runtime.pid)
    titles = " ".join(" ".join(p.cmdline()) for p in processes)
    assert "mesh-runtime forkserver" in titles and "model=m" in titles and "worker spare" in titles
    runtime.process.kill()
    runtime.process.wait()
    wait_until(lambda: not alive(processes), timeout=10, what="every process of the old tree to end")
    runtime.stop()


def test_new_front_kills_what_an_earlier_one_left_on_the_same_runtime_dir(tmp_path):
    # multiprocessing's temp folder (the fork servers' listener sockets) is in TMPDIR, not RUNTIME_DIR.
    def temp_folders() -> list[str]:
        return sorted(name for name in os.listdir(tmp_path) if name.startswith("pymp-"))

    first = Runtime(TMPDIR=str(tmp_path)).start()
    run_dir = first.env["RUNTIME_DIR"]
    [first_temp] = temp_folders()
    # Real workers die with the front (parent-death signal); this one stands for a worker that
    # outlived it. Beside it, a process of ours the records name that is no mesh-runtime process.
    left_behind = start_titled(titles.title("worker model=m", run_dir))
    unrelated = subprocess.Popen(["sleep", "120"])
    try:
        first.load("m", first.model_dir("m"))
        record(run_dir, left_behind, unrelated)
        first.process.kill()  # it leaves its folder, its lock file and its records behind
        first.process.wait()
        second = Runtime(RUNTIME_DIR=run_dir, TMPDIR=str(tmp_path)).start()
        try:
            assert left_behind.wait(10) == -signal.SIGKILL
            assert f"killing pid {left_behind.pid}, left behind by an earlier runtime" in second.log()
            assert unrelated.poll() is None and f"leaving pid {unrelated.pid} alone" in second.log()
            second.load("m2", second.model_dir("m2"))
            assert second.infer_fp32("m2", [1.0]).outputs
            assert f"removed {tmp_path / first_temp}, multiprocessing's temp folder" in second.log()
            assert len(temp_folders()) == 1 and first_temp not in temp_folders()  # the second's own
        finally:
            second.stop()
        assert temp_folders() == []  # a clean stop leaves none
    finally:
        for child in (left_behind, unrelated):
            child.kill()
            child.wait()
        first.stop()


def test_runtime_dir_is_private(rt):
    info = os.stat(rt.env["RUNTIME_DIR"])
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()


def test_worker_titles_and_tree(rt):
    rt.load("titled__isvc-1", rt.model_dir("titled"))
    worker = rt.worker_for("titled__isvc-1")
    assert "mesh-runtime worker model=titled__isvc-1" in " ".join(worker.cmdline())
    forkserver = psutil.Process(worker.ppid())
    assert "mesh-runtime forkserver" in " ".join(forkserver.cmdline())
    assert forkserver.ppid() == rt.pid
    rt.unload("titled__isvc-1")


def test_worker_killed_from_outside_is_replaced(rt):
    rt.load("victim", rt.model_dir("victim"))
    first = rt.worker_for("victim")
    first.kill()
    wait_until(lambda: "died (killed by SIGKILL); healing" in rt.log(), what="the front to notice")
    assert rt.infer_fp32("victim", [1.0]).outputs  # waits for the heal, then served
    second = rt.worker_for("victim")
    assert second is not None and second.pid != first.pid
    rt.unload("victim")


def test_idle_front_burns_no_cpu_after_serving():
    """BUSY_POLL_US polls only while replies are due: an idle front sleeps.

    A 200 ms window makes a mistake visible: polling after each heartbeat
    would burn a tenth of a core or more.
    """
    with Runtime(BUSY_POLL_US="200000", WORKERS_WARM="1") as rt:
        rt.load("idle-check", rt.model_dir("idle-check"))
        for _ in range(20):
            rt.infer_fp32("idle-check", [1.0, 2.0])
        front = psutil.Process(rt.pid)
        before = sum(front.cpu_times()[:2])
        time.sleep(3.0)
        burnt = sum(front.cpu_times()[:2]) - before
        assert burnt < 0.15, f"the idle front used {burnt:.2f} s of CPU in 3 s"


def test_front_without_busy_polling_serves():
    with Runtime(BUSY_POLL_US="0", WORKERS_WARM="1") as rt:
        rt.load("no-polling", rt.model_dir("no-polling"))
        assert rt.infer_fp32("no-polling", [1.0, 2.0]).outputs


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_front_serves_on_either_event_loop_and_says_which(event_loop):
    with Runtime(EVENT_LOOP=event_loop, WORKERS_WARM="1") as rt:
        rt.load("looped", rt.model_dir("looped"))
        assert rt.infer_fp32("looped", [1.0, 2.0]).outputs
        assert f"(event loop: {event_loop})" in rt.log()


def test_uvloop_is_the_default_event_loop():
    with Runtime(WORKERS_WARM="0") as rt:
        assert "(event loop: uvloop)" in rt.log()


def _policies(process: psutil.Process) -> set[int]:
    """The scheduling policy of every thread of `process`."""
    return {os.sched_getscheduler(thread.id) for thread in process.threads()}


def _named_policies(process: psutil.Process) -> list[tuple[int, str, int]]:
    """(thread id, the kernel's name for it, its scheduling policy) for every thread."""
    named = []
    for thread in process.threads():
        try:  # threads come and go (grpc's, the executors', a fork's timer): one may end meanwhile
            with open(f"/proc/{process.pid}/task/{thread.id}/comm") as comm:
                named.append((thread.id, comm.read().strip(), os.sched_getscheduler(thread.id)))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return named


# Names grpc 1.85 gives its threads; checked only where present, since a later grpc may rename them.
GRPC_THREAD_NAMES = {"grpc_global_tim", "event_engine", "lifeguard"}


def _assert_front_grpc_threads_batch_and_the_rest_not(front: psutil.Process):
    named = _named_policies(front)
    front_name = next(name for tid, name, _ in named if tid == front.pid)
    for tid, name, policy in named:
        if name in GRPC_THREAD_NAMES:
            assert policy == os.SCHED_BATCH, name
        elif tid == front.pid or name.startswith("ZMQbg/"):  # the event loop and ZeroMQ's threads
            assert policy == os.SCHED_OTHER, name
    batch = [name for _, name, policy in named if policy == os.SCHED_BATCH]
    assert len(batch) >= 3, named  # grpc's timer, completion-queue poller, event engine
    assert front_name in batch  # the poller is a Python thread, named like the front


def test_workers_and_the_fronts_grpc_threads_run_as_batch_work_the_event_loop_does_not():
    with Runtime(WORKERS_WARM="1") as rt:
        rt.load("batch", rt.model_dir("batch"))
        assert rt.infer_fp32("batch", [1.0]).outputs
        worker = rt.worker_for("batch")
        assert len(worker.threads()) > 1  # ZeroMQ's threads inherit the policy too
        assert _policies(worker) == {os.SCHED_BATCH}
        _assert_front_grpc_threads_batch_and_the_rest_not(psutil.Process(rt.pid))


def test_worker_batch_scheduling_can_be_turned_off():
    with Runtime(WORKERS_WARM="1", WORKER_SCHED_BATCH="false") as rt:
        rt.load("normal", rt.model_dir("normal"))
        assert _policies(rt.worker_for("normal")) == {os.SCHED_OTHER}
        _assert_front_grpc_threads_batch_and_the_rest_not(psutil.Process(rt.pid))


def test_grpc_threads_batch_scheduling_can_be_turned_off():
    with Runtime(WORKERS_WARM="1", GRPC_THREADS_SCHED_BATCH="false") as rt:
        rt.load("normal", rt.model_dir("normal"))
        assert rt.infer_fp32("normal", [1.0]).outputs
        assert _policies(psutil.Process(rt.pid)) == {os.SCHED_OTHER}
        assert _policies(rt.worker_for("normal")) == {os.SCHED_BATCH}


def _refuse(pid, policy, param):
    raise PermissionError(1, "Operation not permitted")


def test_batch_scheduling_refused_by_the_kernel_is_reported_not_raised(monkeypatch, caplog):
    from runtime import server
    from runtime.settings import Settings

    monkeypatch.setattr(os, "sched_setscheduler", _refuse)
    assert priority.schedule_as_batch_work() is False
    with priority.threads_started_here_run_as_batch_work() as batch:
        assert batch is False
    with caplog.at_level(logging.WARNING, logger="mesh.server"):
        with server.grpc_threads_as_batch_work(Settings.from_env({})):
            pass
    assert "the kernel refused SCHED_BATCH (GRPC_THREADS_SCHED_BATCH)" in caplog.text


def test_threads_started_inside_the_block_run_as_batch_work_and_the_starter_keeps_its_policy():

    policies = {}

    def record(when):
        policies[when] = os.sched_getscheduler(0)  # 0: the calling thread

    def run_thread(when):
        thread = threading.Thread(target=record, args=(when,))
        thread.start()
        thread.join()

    before = os.sched_getscheduler(0)
    with priority.threads_started_here_run_as_batch_work() as batch:
        run_thread("inside")
    run_thread("after")
    assert batch is True
    assert policies == {"inside": os.SCHED_BATCH, "after": before}
    assert os.sched_getscheduler(0) == before


def _run_until_it_exits(rt: Runtime) -> tuple[int, str, bool]:
    """Starts a runtime that is expected to stop by itself; returns its exit code, its log and
    whether its RUNTIME_DIR is still there."""
    rt.start(wait_ready=False)
    try:
        return rt.process.wait(30), rt.log(), os.path.exists(rt.env["RUNTIME_DIR"])
    finally:
        rt.stop()


@pytest.mark.parametrize("runtime_dir", ["the first front's", "its own"])
def test_a_second_front_on_a_taken_port_exits_2_and_leaves_the_first_alone(runtime_dir):
    """On the first front's RUNTIME_DIR the lock on it stops the second front before it touches it."""
    with Runtime(WORKERS_WARM="1") as first:
        first.load("first", first.model_dir("first"))
        worker = first.worker_for("first")
        env = {"RUNTIME_DIR": first.env["RUNTIME_DIR"]} if runtime_dir == "the first front's" else {}
        code, log, left_its_folder = _run_until_it_exits(Runtime(RUNTIME_PORT=str(first.port), **env))
        expected = (
            f"is in use by another front (pid {first.pid})" if env else f"cannot listen on port {first.port}"
        )
        assert code == 2 and expected in log
        assert env or not left_its_folder, "a front that could not listen removes its RUNTIME_DIR"
        assert worker.is_running() and os.path.isdir(first.env["RUNTIME_DIR"])
        assert first.infer_fp32("first", [1.0]).outputs


def test_a_taken_metrics_port_stops_the_front_with_exit_2_and_the_reason():
    with socket.socket() as taken:
        taken.bind(("", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, log, left_its_folder = _run_until_it_exits(Runtime(METRICS_PORT=str(port)))
    assert code == 2 and f"cannot serve metrics on METRICS_PORT={port}" in log
    assert not left_its_folder


def test_a_forgotten_process_is_no_longer_polled_at_each_start_but_still_joins():
    # multiprocessing polls every child it knows at each start(): the pool's
    # workers are forgotten, so a load does not cost more per model loaded.
    process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(1,))
    process.start()
    forkserver.forget(process)
    assert process not in multiprocessing.active_children()  # alive, yet no longer listed
    process.join(timeout=10)
    assert process.exitcode == 0


def test_a_process_about_to_be_killed_is_made_idle_work_in_every_thread():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import threading, time; threading.Thread(target=time.sleep, args=(60,)).start(); "
            "print(1, flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        child.stdout.readline()  # its second thread runs
        assert priority.schedule_process_as_idle_work(child.pid) is True
        threads = os.listdir(f"/proc/{child.pid}/task")
        assert len(threads) == 2
        assert {os.sched_getscheduler(int(t)) for t in threads} == {os.SCHED_IDLE}
    finally:
        child.kill()
        child.wait()
    assert priority.schedule_process_as_idle_work(child.pid) is False  # gone: nothing to do


@pytest.mark.parametrize("cause", list(KillCause))
def test_only_a_recycled_pack_is_made_idle_work_before_its_sigkill(cause):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seen = []

    class Dying:
        pid_identity = lifeline.process_identity(child.pid)
        kill_cause = cause

        def signal(self, signum, whole_group=False):
            seen.append((signum, os.sched_getscheduler(child.pid), whole_group))
            child.send_signal(signum)

    try:
        Worker.kill_now(Dying())  # type: ignore[arg-type]
        idle = cause is KillCause.RECYCLED
        assert seen == [(signal.SIGKILL, os.SCHED_IDLE if idle else os.SCHED_OTHER, True)]
    finally:
        child.kill()
        child.wait()


# A model whose load starts helper processes: one by multiprocessing's fork, one by subprocess, and
# when told to, one that leaves its worker's process group and stops dying with its parent, as a
# daemon would, and one that leaves it below a shell the model started. Each pid is in the folder, a
# line per load.
HELPERS_MODEL = """
    import ctypes, multiprocessing, os, subprocess, time

    def note(path, name, pid):
        with open(os.path.join(path, name), "a") as f:
            f.write(f"{pid}\\n")

    class Model:
        def __init__(self, path):
            self.forked = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
            self.forked.start()
            note(path, "forked.pid", self.forked.pid)
            self.executed = subprocess.Popen(["sleep", "600"])
            note(path, "executed.pid", self.executed.pid)
            if os.path.exists(os.path.join(path, "escape")):
                pid = os.fork()
                if pid == 0:
                    os.setsid()
                    ctypes.CDLL(None).prctl(1, 0, 0, 0, 0)  # PR_SET_PDEATHSIG: none
                    time.sleep(600)
                    os._exit(0)
                note(path, "escaped.pid", pid)
                below = os.path.join(path, "grandchild.pid")
                written = open(below).read() if os.path.exists(below) else ""
                self.shell = subprocess.Popen(["sh", "-c", f"setsid sleep 600 & echo $! >> {below}; wait"])
                while not os.path.exists(below) or open(below).read().count("\\n") == written.count("\\n"):
                    time.sleep(0.01)
            if os.path.exists(os.path.join(path, "fail")):
                raise RuntimeError("failed, its helpers started")

        def predict(self, inputs):
            return dict(inputs)
"""


ALL_HELPERS = ("forked.pid", "executed.pid", "escaped.pid", "grandchild.pid")


def _pids_in(folder: str, *names: str, load: int = -1) -> list[int]:
    """The pids each file names, as the model's last load (or `load`, counted from 0) wrote them."""
    pids = []
    for name in names:
        with open(os.path.join(folder, name)) as f:
            pids.append(int(f.read().split()[load]))
    return pids


def test_what_a_model_started_ends_with_its_worker():
    with Runtime() as runtime:
        folder = runtime.model_dir("helped", HELPERS_MODEL)
        open(os.path.join(folder, "escape"), "w").close()  # one helper leaves the group (setsid)
        runtime.load("helped", folder)
        helpers = [psutil.Process(pid) for pid in _pids_in(folder, *ALL_HELPERS)]
        runtime.unload("helped")
        wait_until(lambda: not alive(helpers), timeout=10, what="the model's helpers to end with its worker")
        # A worker killed from outside (the OOM killer, say): the front ends what is left of its group.
        runtime.load("crashing", runtime.model_dir("crashing", HELPERS_MODEL))
        folder = os.path.join(runtime.models, "crashing")
        helpers = [psutil.Process(pid) for pid in _pids_in(folder, "forked.pid", "executed.pid")]
        os.kill(runtime.worker_for("crashing").pid, signal.SIGKILL)
        wait_until(lambda: not alive(helpers), timeout=10, what="the helpers of a killed worker to end")


def test_a_packed_model_whose_load_starts_processes_moves_out_and_what_it_started_in_its_pack_ends():
    with Runtime(**HELPERS_FIT) as runtime:
        runtime.load("neighbour", runtime.model_dir("neighbour"))
        folder = runtime.model_dir("helped", HELPERS_MODEL)
        open(os.path.join(folder, "escape"), "w").close()
        runtime.load("helped", folder)
        in_the_pack = _pids_in(folder, *ALL_HELPERS, load=0)
        assert all(map(_ended, in_the_pack)), "they are dead by the time loadModel returns"
        helpers = _pids_in(folder, *ALL_HELPERS)  # started by its load in a worker of its own
        assert psutil.Process(helpers[1]).ppid() == runtime.worker_for("helped").pid
        (pack,) = runtime.packs()
        assert "mesh-runtime pack models=1" in " ".join(pack.cmdline())
        assert runtime.infer_fp32("neighbour", [1.0]).outputs and runtime.infer_fp32("helped", [1.0]).outputs
        runtime.unload("helped")
        wait_until(lambda: all(map(_ended, helpers)), timeout=10, what="its helpers to end with its worker")
        folder = runtime.model_dir("failing", HELPERS_MODEL)
        open(os.path.join(folder, "fail"), "w").close()
        expect_status(grpc.StatusCode.FAILED_PRECONDITION, runtime.load, "failing", folder)
        assert all(map(_ended, _pids_in(folder, "forked.pid", "executed.pid")))
        # The pack lives on, or was recycled for what the failed load and helped's copy kept in all.
        assert pack.is_running() or "the failed load of failing left" in runtime.log()
        assert runtime.infer_fp32("neighbour", [1.0]).outputs


# A model whose load starts a helper with multiprocessing's forkserver context: the first such load in
# a pack starts that fork server, and every later model's helper is its child.
FORKSERVER_HELPER_MODEL = """
    import multiprocessing, os, time

    class Model:
        def __init__(self, path):
            context = multiprocessing.get_context("forkserver")
            self.helper = context.Process(target=time.sleep, args=(600,), daemon=True)
            self.helper.start()
            with open(os.path.join(path, "helper.pid"), "a") as f:
                f.write(f"{self.helper.pid}\\n")

        def predict(self, inputs):
            if not self.helper.is_alive():
                raise RuntimeError("my helper is gone")
            return dict(inputs)
"""


def test_a_packed_model_whose_load_starts_multiprocessings_fork_server_leaves_nothing_in_its_pack():
    # The fork server outlives the model's drop, and its helper with it (the fork server's child,
    # not the model's): the pack is recycled, its neighbour moved to a fresh one.
    with Runtime(**HELPERS_FIT) as runtime:
        runtime.load("neighbour", runtime.model_dir("neighbour"))
        old_pack = runtime.packs()[0].pid
        folder = runtime.model_dir("forking", FORKSERVER_HELPER_MODEL)
        runtime.load("forking", folder)
        (in_the_pack,) = _pids_in(folder, "helper.pid", load=0)
        assert _ended(in_the_pack)
        (pack,) = runtime.packs()
        assert pack.pid != old_pack and not pack.children()
        assert "processes the load of forking started outlived it" in runtime.log()
        assert runtime.infer_fp32("neighbour", [1.0]).outputs and runtime.infer_fp32("forking", [1.0]).outputs


def _ended(pid: int) -> bool:
    """Gone, or a zombie until the model's own objects (multiprocessing's, subprocess's) reap it."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL])
@pytest.mark.parametrize("per_worker", ["1", "4"])
def test_what_models_started_ends_with_the_front_even_what_left_its_workers_group(stop, per_worker):
    runtime = Runtime(**(HELPERS_FIT if per_worker == "4" else {})).start()
    folder = runtime.model_dir("escaping", HELPERS_MODEL)
    open(os.path.join(folder, "escape"), "w").close()  # one helper leaves the group (setsid)
    runtime.load("escaping", folder)
    helpers = [psutil.Process(pid) for pid in _pids_in(folder, *ALL_HELPERS)]
    try:
        started = time.monotonic()
        runtime.process.send_signal(stop)
        code = runtime.process.wait(forkserver.STOP_SECONDS + 20)
        assert code == (0 if stop == signal.SIGTERM else -signal.SIGKILL)
        # Killed with their workers as the front stops, or by the fork servers as it dies; the helper
        # that holds a fork server's pipe too, so that its stop is not held.
        wait_until(lambda: not alive(helpers), timeout=10, what="every helper to end with the front")
        assert (
            time.monotonic() - started < forkserver.STOP_SECONDS
            and "did not stop within" not in runtime.log()
        )
    finally:
        for helper in helpers:
            with contextlib.suppress(psutil.NoSuchProcess):
                helper.kill()
        runtime.stop()


def test_a_process_that_exited_and_is_not_reaped_yet_is_exiting_and_a_running_one_is_not():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    identity = lifeline.process_identity(child.pid)
    assert not lifeline.is_exiting(identity) and not lifeline.is_exiting(
        lifeline.process_identity(os.getpid())
    )
    child.stdin.close()  # it exits
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # a zombie now, not reaped
    assert lifeline.is_exiting(identity)
    assert not lifeline.is_exiting((child.pid, identity[1] + 1))  # another process that took its pid
    child.wait()
    assert not lifeline.is_exiting(identity)  # gone


# Keeps a pool of forked workers, each of which answered once; writes their pids.
POOL_MODEL = """
    import multiprocessing, os

    def _pid(_):
        return os.getpid()

    class Model:
        def __init__(self, path):
            self.pool = multiprocessing.get_context("fork").Pool(2)
            pids = set(self.pool.map(_pid, range(8), chunksize=1))
            with open(os.path.join(path, "pool.pids"), "w") as pids_file:
                pids_file.write(" ".join(map(str, pids)))

        def predict(self, inputs):
            return dict(inputs)
"""


@pytest.mark.parametrize(
    "settings", [{"MODELS_PER_WORKER": "8"}, HELPERS_FIT], ids=["outgrows", "has-processes"]
)
def test_a_packed_model_holding_a_pool_is_dropped_and_its_pack_serves_on(settings):
    # Its pool's workers killed first, the pool's finalizer waited for ever on the lock one of them
    # held, and the pack with it: its load, moving out of the pack, timed out.
    with Runtime(**settings) as runtime:
        runtime.load("neighbour", runtime.model_dir("neighbour"))
        folder = runtime.model_dir("pooled", POOL_MODEL)
        runtime.load("pooled", folder, timeout=30)
        with open(os.path.join(folder, "pool.pids")) as pids_file:
            workers = [int(pid) for pid in pids_file.read().split()]
        assert runtime.infer_fp32("neighbour", [1.0]).outputs
        runtime.unload("pooled")
        assert runtime.infer_fp32("neighbour", [1.0]).outputs
        wait_until(lambda: all(map(_ended, workers)), timeout=10, what="the pool's workers to end")


# Answers after a second, once it has said it started.
SLOW_ECHO_MODEL = """
    import os, time

    class Model:
        def __init__(self, path):
            self.path = path

        def predict(self, inputs):
            open(os.path.join(self.path, "started"), "w").close()
            time.sleep(1)
            return dict(inputs)
"""


# The front leads a process group of its own here, as under a terminal or a service manager.
@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGHUP], ids=["SIGKILL", "SIGHUP"])
def test_a_signal_to_the_fronts_process_group_ends_every_process_and_what_models_started(signum):
    with Runtime(command_prefix=("setsid",), MODELS_PER_WORKER="4") as runtime:
        for name in ("alone", "packed"):
            runtime.load(name, runtime.model_dir(name, HELPERS_MODEL))
        helpers = [
            psutil.Process(pid)
            for name in ("alone", "packed")
            for pid in _pids_in(os.path.join(runtime.models, name), "forked.pid", "executed.pid")
        ]
        processes = tree(runtime.pid)
        assert os.getpgid(runtime.pid) == runtime.pid
        os.killpg(runtime.pid, signum)
        wait_until(lambda: not alive(processes + helpers), timeout=10, what="every process and helper to end")


def test_sigterm_to_the_fronts_process_group_stops_it_as_gracefully_as_sigterm_to_the_front():
    with Runtime(command_prefix=("setsid",)) as runtime:
        runtime.load("slow", runtime.model_dir("slow", SLOW_ECHO_MODEL))
        processes = tree(runtime.pid)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            call = pool.submit(runtime.infer_fp32, "slow", [1.0])
            wait_until(lambda: os.path.exists(os.path.join(runtime.models, "slow", "started")))
            os.killpg(runtime.pid, signal.SIGTERM)
            assert call.result(timeout=30).outputs  # answered, its worker not killed under it
        assert runtime.process.wait(15) == 0
        wait_until(lambda: not alive(processes), timeout=10, what="every process to end")
        assert "died" not in runtime.log() and "heal" not in runtime.log()


# Starts a helper by fork from a thread that ends before the load does.
THREAD_HELPER_MODEL = """
    import multiprocessing, os, threading, time

    class Model:
        def __init__(self, path):
            helpers = []
            starter = threading.Thread(target=lambda: helpers.append(self._start_helper()))
            starter.start()
            starter.join()
            with open(os.path.join(path, "helper.pid"), "w") as f:
                f.write(str(helpers[0].pid))

        @staticmethod
        def _start_helper():
            helper = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
            helper.start()
            time.sleep(0.2)  # the thread ends after the helper is under way, not before
            return helper

        def predict(self, inputs):
            return dict(inputs)
"""


def test_a_helper_forked_from_a_thread_that_ends_lives_on_and_still_ends_with_its_worker():
    with Runtime() as runtime:
        folder = runtime.model_dir("threaded", THREAD_HELPER_MODEL)
        runtime.load("threaded", folder)
        helper = psutil.Process(_pids_in(folder, "helper.pid")[0])
        time.sleep(0.3)  # a parent-death signal tied to the thread would have come by now
        assert alive([helper]), "the helper died with the thread that started it"
        runtime.unload("threaded")
        wait_until(lambda: not alive([helper]), timeout=10, what="the helper to end with its worker")


def test_runtime_socket_path_serves_refuses_a_second_front_and_is_bound_over_once_stale(tmp_path):
    path = str(tmp_path / "mesh.sock")
    with Runtime(RUNTIME_SOCKET_PATH=path) as first:
        first.load("m", first.model_dir("m"))
        with grpc.insecure_channel(f"unix:{path}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        code, log, _ = _run_until_it_exits(Runtime(RUNTIME_SOCKET_PATH=path))
        assert code == 2 and f"cannot listen on unix:{path} (RUNTIME_SOCKET_PATH)" in log
        assert os.path.exists(path) and first.infer_fp32("m", [1.0]).outputs
        first.process.kill()  # gone without removing its socket
        first.process.wait()
    assert os.path.exists(path)
    with Runtime(RUNTIME_SOCKET_PATH=path) as second:
        assert "cannot listen" not in second.log()
    assert not os.path.exists(path)


def test_runtime_socket_path_lets_model_mesh_connect_under_another_uid(tmp_path):
    # model-mesh's container runs under a uid of its own; connecting needs write permission.
    path = str(tmp_path / "mesh.sock")
    with Runtime(RUNTIME_SOCKET_PATH=path):
        assert stat.S_IMODE(os.stat(path).st_mode) & 0o022 == 0o022, oct(os.stat(path).st_mode)


@pytest.mark.slow  # waits out the workers' exits (10 s) and the fork server's stop (5 s)
def test_a_front_stops_cleanly_though_its_fork_server_is_stopped():
    with Runtime() as runtime:
        runtime.load("m", runtime.model_dir("m"))
        runtime.settled_uss()  # the spare the load took is replaced: no start waits on the fork server
        processes = tree(runtime.pid)
        (server,) = runtime.forkservers()
        server.suspend()  # it writes no worker's exit until it is killed
        runtime.process.send_signal(signal.SIGTERM)
        assert runtime.process.wait(40) == 0
        log = runtime.log()
        assert "stopped; every worker reaped" in log and "Traceback" not in log, log[-3000:]
        wait_until(lambda: not alive(processes), timeout=10, what="every process to end")


def test_a_unix_socket_is_taken_for_answered_while_anything_listens_on_it(tmp_path):
    path = str(tmp_path / "probe.sock")
    assert not server.answers_on(path)  # nothing there
    (tmp_path / "a-file").write_text("")
    assert not server.answers_on(str(tmp_path / "a-file" / "x.sock"))  # no socket: grpc says why
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        assert not server.answers_on(path)  # bound, not listening: as a front that is gone leaves it
        listener.listen(0)
        assert server.answers_on(path)
        waiting = []
        try:  # a listener too busy to take one more still listens
            while True:
                client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                waiting.append(client)
                client.setblocking(False)
                client.connect(path)
        except BlockingIOError:
            assert server.answers_on(path)
        finally:
            for client in waiting:
                client.close()
