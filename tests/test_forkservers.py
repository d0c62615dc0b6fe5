"""runtime/forkserver.py: one fork server per framework, each started by its format's first load,
each with WORKERS_WARM spares of its own, and room made at WORKERS_MAX."""

import functools
import multiprocessing
import os
import signal

import psutil
import pytest
from harness import Runtime, alive, wait_until
from test_formats import make_examples

from plumbing import lifeline, logsetup, titles
from runtime import forkserver
from workers import protocol

PRELOAD = ("numpy", "sklearn")


@pytest.fixture(autouse=True)
def environment_restored(monkeypatch):
    """ForkServers sets the environment a fork server reads as it starts in this very process: put
    back, or a later import of workers.preload here would preload what a test asked for (one kills
    the process that imports it)."""
    for name in (
        protocol.PRELOAD_ENV,
        protocol.FORKSERVER_GROUP_ENV,
        titles.RUNTIME_DIR_ENV,
        logsetup.LOG_ENV,
    ):
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:  # recorded as unset by the setenv, so that the undo removes what the test set
            monkeypatch.setenv(name, "")
            monkeypatch.delenv(name)


class Records:
    """Stands in for the pool's ProcessRegistry: the fork servers' pids as they start and are reaped."""

    def __init__(self):
        self.added: list[int] = []
        self.removed: list[int] = []

    def add(self, pid: int) -> None:
        self.added.append(pid)

    def remove(self, pid: int) -> None:
        self.removed.append(pid)


def test_a_format_is_forked_by_its_frameworks_server_when_that_is_preloaded_else_by_the_base_one():
    assert forkserver.group_for("python", PRELOAD) == forkserver.BASE_GROUP
    assert forkserver.group_for("sklearn", PRELOAD) == "sklearn"
    assert forkserver.group_for("xgboost", PRELOAD) == forkserver.BASE_GROUP  # xgboost not preloaded
    assert forkserver.group_for("no-such-format", PRELOAD) == forkserver.BASE_GROUP


def test_frameworks_that_import_scikit_learn_share_its_fork_server():
    preload = ("numpy", "sklearn", "xgboost", "lightgbm", "torch")
    groups = {forkserver.group_for(fmt, preload) for fmt in ("sklearn", "xgboost", "lightgbm")}
    assert groups == {"sklearn+xgboost+lightgbm"}
    assert forkserver.group_for("xgboost", ("numpy", "xgboost")) == "xgboost"
    assert forkserver.group_for("pytorch", preload) == "torch"


def test_the_base_fork_server_imports_no_framework_and_each_other_its_frameworks():
    preload = ("numpy", "sklearn", "xgboost", "torch", "mymodule")
    servers = forkserver.ForkServers(preload, "/run/x", ("info", "text"), Records())
    assert servers.groups() == (forkserver.BASE_GROUP, "sklearn+xgboost", "torch")
    assert servers.preload_of(forkserver.BASE_GROUP) == ("numpy", "mymodule")
    assert servers.preload_of("sklearn+xgboost") == ("numpy", "mymodule", "sklearn", "xgboost")


def test_starting_every_fork_server_returns_once_each_has_imported_its_preload(tmp_path):
    records = Records()
    started = records.added
    servers = forkserver.ForkServers(("numpy",), str(tmp_path), ("info", "text"), records)
    try:
        servers.start_all()  # the front reads their cost next, for the capacity it reports
        assert started and all("/numpy/" in open(f"/proc/{pid}/maps").read() for pid in started)
    finally:
        servers.stop()


def test_a_fork_server_that_stops_answering_is_killed_and_the_next_start_gets_another(tmp_path, monkeypatch):
    monkeypatch.setattr(forkserver, "FORK_SECONDS", 0.5)
    records = Records()
    started = records.added
    servers = forkserver.ForkServers(("numpy",), str(tmp_path), ("info", "text"), records)
    try:
        servers.start_all()
        (stopped,) = started
        server = psutil.Process(stopped)
        server.suspend()  # it runs, and answers nothing
        with pytest.raises(EOFError):  # not a wait for ever on the spawner thread
            servers.start_process(forkserver.BASE_GROUP, probe())
        wait_until(lambda: not alive([server]), what="the stopped fork server killed")
        forked = probe()
        servers.start_process(forkserver.BASE_GROUP, forked)
        forked.join(timeout=30)
        assert forked.exitcode == 0 and len(started) == 2 and records.removed == [stopped]
    finally:
        servers.stop()


def test_a_start_right_after_the_fork_server_was_killed_gets_another(tmp_path):
    records = Records()
    servers = forkserver.ForkServers(("numpy",), str(tmp_path), ("info", "text"), records)
    try:
        servers.start_all()
        for _ in range(10):  # multiprocessing alone failed about half of such starts
            identity = servers.identity_of(forkserver.BASE_GROUP)
            assert identity is not None
            os.kill(identity[0], signal.SIGKILL)  # the OOM killer, say, as a load comes in
            wait_until(functools.partial(lifeline.is_exiting, identity), what="the fork server exiting")
            forked = probe()
            servers.start_process(forkserver.BASE_GROUP, forked)  # not EOFError from the dying one
            forked.join(timeout=30)
            assert forked.exitcode == 0
        assert len(records.added) == 11 and records.removed == records.added[:10]
    finally:
        servers.stop()


def test_a_fork_server_reaped_by_a_start_elsewhere_is_dead_for_its_workers_exits(tmp_path, monkeypatch):
    # A start on the group's thread found it killed, and multiprocessing reaped it while starting
    # another: a worker's exit read meanwhile must still be its fork server's death, not a crash.
    servers = forkserver.ForkServers(("numpy",), str(tmp_path), ("info", "text"), Records())
    try:
        servers.start_all()
        identity = servers.identity_of(forkserver.BASE_GROUP)
        assert identity is not None and not servers.revive_if_dead(forkserver.BASE_GROUP, identity)
        monkeypatch.setattr(forkserver.lifeline, "is_exiting", lambda identity: False)
        monkeypatch.setattr(forkserver.lifeline, "is_running", lambda identity: False)  # no /proc entry
        assert servers.revive_if_dead(forkserver.BASE_GROUP, identity)
    finally:
        monkeypatch.undo()
        servers.stop()


def test_a_fork_server_started_again_gets_the_time_to_import_its_preload_until_it_has_forked(tmp_path):
    records = Records()
    servers = forkserver.ForkServers(("numpy",), str(tmp_path), ("info", "text"), records)
    group = forkserver.BASE_GROUP
    try:
        assert servers.fork_limit(group) == forkserver.PRELOAD_SECONDS  # none yet
        servers.start_all()
        assert servers.fork_limit(group) == forkserver.FORK_SECONDS
        first = servers.identity_of(group)
        os.kill(first[0], signal.SIGKILL)
        wait_until(lambda: servers.revive_if_dead(group, first), what="the fork server started again")
        assert servers.identity_of(group) != first
        assert servers.fork_limit(group) == forkserver.PRELOAD_SECONDS  # it may still be importing
        forked = probe()
        servers.start_process(group, forked)
        forked.join(timeout=30)
        assert servers.fork_limit(group) == forkserver.FORK_SECONDS
    finally:
        servers.stop()


def test_a_fork_server_that_dies_as_the_pool_starts_is_started_again(tmp_path, monkeypatch, caplog):
    servers = forkserver.ForkServers(("numpy",), str(tmp_path), ("info", "text"), Records())
    real_start, deaths = servers.start_process, [EOFError("unexpected EOF")]

    def dies_once(group, process):
        if deaths:
            raise deaths.pop()
        return real_start(group, process)

    monkeypatch.setattr(servers, "start_process", dies_once)
    try:
        servers.start_all()
        assert servers.all_running()
        assert "the base fork server died as it started (EOFError('unexpected EOF'), " in caplog.text
        assert "it preloads numpy); starting it again" in caplog.text
    finally:
        servers.stop()


def test_a_fork_server_that_dies_at_every_start_stops_the_pool_saying_how_it_died_and_what_it_preloads(
    tmp_path, caplog
):
    preload = ("numpy", "meshtest.killed_at_import")
    servers = forkserver.ForkServers(preload, str(tmp_path), ("info", "text"), Records())
    try:
        with pytest.raises(RuntimeError) as raised:
            servers.start_all()
    finally:
        servers.stop()
    died = "killed by SIGKILL; it preloads numpy, meshtest.killed_at_import"
    assert (
        f"the base fork server died as it started 3 times in a row (EOFError('unexpected EOF'), {died})"
        in (str(raised.value))
    )
    assert "take what it cannot import out of WORKER_PRELOAD" in str(raised.value)
    assert f"{died}); starting it again" in caplog.text


def probe() -> multiprocessing.process.BaseProcess:
    return multiprocessing.get_context("forkserver").Process(target=os.getpid)


def sklearn_model(rt: Runtime) -> str:
    folder = os.path.join(rt.models, "iris-sklearn")
    os.makedirs(folder, exist_ok=True)
    make_examples.write_sklearn(folder, make_examples.iris())
    return folder


def forkserver_of(rt: Runtime, model_id: str) -> str:
    worker = rt.worker_for(model_id)
    assert worker is not None, f"no worker serves {model_id}"
    return " ".join(psutil.Process(worker.ppid()).cmdline())


@pytest.mark.slow  # starts a second fork server, which imports scikit-learn
def test_each_preloaded_framework_has_a_fork_server_from_the_start_with_spares_of_its_own():
    pytest.importorskip("sklearn", reason="pip install 'mesh-runtime[sklearn]'")
    with Runtime(WORKER_PRELOAD=",".join(PRELOAD), WORKERS_WARM="1") as rt:
        assert sorted(" ".join(p.cmdline()).split()[2] for p in rt.forkservers()) == ["base", "sklearn"]
        assert sorted(spare_parents(rt)) == ["base", "sklearn"]  # ready before the runtime said so
        rt.load("echo", rt.model_dir("echo"))
        rt.load("iris", sklearn_model(rt), fmt="sklearn")
        assert "mesh-runtime forkserver base " in forkserver_of(rt, "echo")
        assert "mesh-runtime forkserver sklearn " in forkserver_of(rt, "iris")
        wait_until(lambda: sorted(spare_parents(rt)) == ["base", "sklearn"], timeout=30, what="both refilled")


def title(pid: int) -> str:
    return " ".join(psutil.Process(pid).cmdline())


def spare_parents(rt: Runtime) -> list[str]:
    """The group of the fork server each idle spare was forked from."""
    return [title(spare.ppid()).split()[2] for spare in alive(rt.spares())]


@pytest.mark.slow  # starts a second fork server, which imports scikit-learn
def test_at_workers_max_a_spare_of_another_fork_server_makes_room():
    pytest.importorskip("sklearn", reason="pip install 'mesh-runtime[sklearn]'")
    with Runtime(WORKER_PRELOAD=",".join(PRELOAD), WORKERS_WARM="1", WORKERS_MAX="2") as rt:
        (sklearn_spare,) = [
            s for s in alive(rt.spares()) if "sklearn" in " ".join(psutil.Process(s.ppid()).cmdline())
        ]
        rt.load("echo", rt.model_dir("echo"))  # the base spare: the cap is reached
        rt.load("echo2", rt.model_dir("echo2"))  # no base spare, and no room for one: the other goes
        assert not alive([sklearn_spare])
        assert "mesh-runtime forkserver base " in forkserver_of(rt, "echo2")
        assert rt.model_workers() == 2


@pytest.mark.parametrize("per_worker", ["1", "4"])
def test_a_fork_server_that_dies_is_reaped_at_once_and_its_workers_deaths_count_against_no_model(per_worker):
    from harness import free_port, metric_sample, scrape_metrics

    env = {"MODEL_CRASH_LIMIT": "1", "MODELS_PER_WORKER": per_worker, "METRICS_PORT": str(free_port())}
    with Runtime(**env) as rt:
        rt.load("a", rt.model_dir("a"))
        (base,) = rt.forkservers()
        base.kill()
        # Its worker dies with it: a crash of "a" would drop it (MODEL_CRASH_LIMIT=1), this heals it.
        wait_until(lambda: "healed a" in rt.log(), timeout=30, what="a healed")
        assert list(rt.infer_fp32("a", [1.5]).outputs[0].contents.fp32_contents) == [1.5]
        assert "exited (its fork server died)" in rt.log() and "dropping a" not in rt.log()
        assert not psutil.pid_exists(base.pid), "reaped at once, not left a zombie"
        # Another is started (a worker just forked from it carries its title for a moment).
        wait_until(lambda: len(alive(rt.forkservers())) == 1, timeout=10, what="one base fork server")
        assert (
            metric_sample(scrape_metrics(rt), "mesh_worker_restarts_total", model="a", cause="forkserver")
            == 1
        )


def test_a_fork_server_that_dies_with_no_worker_of_its_own_is_reaped_and_started_again():
    with Runtime(WORKERS_WARM="0") as rt:
        (base,) = rt.forkservers()
        base.kill()
        wait_until(lambda: not psutil.pid_exists(base.pid), timeout=10, what="the dead fork server reaped")
        wait_until(lambda: len(alive(rt.forkservers())) == 1, timeout=20, what="another started")
        assert "the base fork server died" in rt.log()
        records = os.listdir(os.path.join(rt.env["RUNTIME_DIR"], "pids"))
        assert str(base.pid) not in records and str(rt.forkservers()[0].pid) in records


@pytest.mark.parametrize("per_worker", ["1", "4"])
def test_a_load_whose_fork_server_dies_fails_saying_so_and_the_model_loads_again_after(per_worker):
    import grpc
    from harness import expect_status
    from test_packs import GATED_MODEL

    with Runtime(MODELS_PER_WORKER=per_worker) as rt:
        loading = rt.load_future("gated", rt.model_dir("gated", GATED_MODEL))
        wait_until(lambda: rt.worker_for("gated") or rt.packs(), timeout=20, what="the load under way")
        (base,) = rt.forkservers()
        base.kill()  # its worker, loading, dies with it
        error = expect_status(grpc.StatusCode.FAILED_PRECONDITION, loading.result, timeout=30)
        assert "the worker loading 'gated' died (its fork server died)" in error.details()
        assert "exit code" not in error.details()
        rt.load("echo", rt.model_dir("echo"))  # from the fork server started again
        assert list(rt.infer_fp32("echo", [2.0]).outputs[0].contents.fp32_contents) == [2.0]
