"""RUNTIME_DIR is trusted only if we made it; one front per RUNTIME_DIR; any number of SIGINTs exit 0.

Unit tests of runtime/rundir.py and runtime/leftovers.py, then real fronts
(tests/harness.Runtime) for what only the whole start order shows.
"""

import asyncio
import errno
import logging
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import psutil
import pytest
from harness import Runtime, alive, tree, wait_until

from plumbing import titles
from runtime import rundir
from runtime.leftovers import ProcessRegistry

STRANGER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="needs root to start or own things as another uid")


# -- helpers ----------------------------------------------------------------------


def start_titled(title: str) -> subprocess.Popen:
    """A sleeping python child that titles itself `title` with setproctitle, as the runtime's processes do."""
    code = f"import time, setproctitle; setproctitle.setproctitle({title!r}); time.sleep(120)"
    return _wait_titled(subprocess.Popen([sys.executable, "-c", code]), title)


def start_strangers_titled(title: str) -> subprocess.Popen:
    """The same as another uid's process; perl, since the stranger may not reach our python."""
    if shutil.which("perl") is None:
        pytest.skip("needs perl to title a process of another uid")
    code = f"$0 = '{title}'; sleep 120"
    return _wait_titled(
        subprocess.Popen(["perl", "-e", code], user=STRANGER_UID, group=STRANGER_UID, extra_groups=[]), title
    )


def _wait_titled(child: subprocess.Popen, title: str) -> subprocess.Popen:
    def titled() -> bool:
        return (
            child.poll() is not None or " ".join(p for p in psutil.Process(child.pid).cmdline() if p) == title
        )

    wait_until(titled, what="the child's title")
    assert child.poll() is None, "the titled child exited"
    return child


def start_sleeper(user: int | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        ["sleep", "120"], user=user, group=user, extra_groups=[] if user is not None else None
    )


def record(runtime_dir: str, *children: subprocess.Popen) -> None:
    """Writes pids/<pid> with each child's true start time, the way a front records its children."""
    registry = ProcessRegistry(runtime_dir)
    for child in children:
        registry.add(child.pid)


def end(*children: subprocess.Popen) -> None:
    for child in children:
        if child.poll() is None:
            child.kill()
        child.wait()


def listing(folder: str) -> set[str]:
    return {
        os.path.relpath(os.path.join(top, name), folder)
        for top, folders, files in os.walk(folder)
        for name in folders + files
    }


def private_folder_with_our_records(path: str) -> None:
    """What an earlier front leaves: pids/, stacks/, records, a socket; all ours and private."""
    os.makedirs(os.path.join(path, "stacks"), mode=0o700)
    os.makedirs(os.path.join(path, "pids"), mode=0o700)
    for name in ("pids/101", "stacks/101"):
        with open(os.open(os.path.join(path, name), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write("1.0")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(os.path.join(path, "workers.sock"))


@pytest.fixture
def run_dir(tmp_path):
    return str(tmp_path / "run")


# -- the folder itself -----------------------------------------------------------------


def test_prepare_makes_a_private_folder_and_locks_it_with_our_pid(run_dir):
    with rundir.prepare(run_dir):
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        lock_path = os.path.join(run_dir, rundir.LOCK_NAME)
        assert stat.S_IMODE(os.lstat(lock_path).st_mode) == 0o600
        with open(lock_path) as lock_file:
            assert lock_file.read().strip() == str(os.getpid())


def test_a_second_lock_on_the_folder_is_refused_naming_the_holder_until_it_is_released(run_dir):
    first = rundir.prepare(run_dir)
    with pytest.raises(rundir.RuntimeDirError, match=f"in use by another front \\(pid {os.getpid()}\\)"):
        rundir.prepare(run_dir)
    first.close()
    rundir.prepare(run_dir).close()


def test_a_full_disk_refuses_the_lock_with_a_line_naming_runtime_dir_not_a_traceback(run_dir, monkeypatch):
    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(rundir.RuntimeDirError, match="RUNTIME_DIR: cannot write .*: No space left on device"):
        rundir.prepare(run_dir)


def test_a_symlinked_runtime_dir_is_refused_and_its_target_left_as_it_was(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o755)
    (target / "kept").write_text("x")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(rundir.RuntimeDirError, match="is a symlink"):
        rundir.prepare(str(link))
    assert stat.S_IMODE(target.stat().st_mode) == 0o755 and listing(str(target)) == {"kept"}


@needs_root
def test_a_folder_of_another_uid_is_refused(run_dir):
    os.makedirs(run_dir, mode=0o700)
    os.chown(run_dir, STRANGER_UID, STRANGER_UID)
    with pytest.raises(rundir.RuntimeDirError, match=f"belongs to uid {STRANGER_UID}"):
        rundir.prepare(run_dir)


def test_a_folder_others_could_write_to_is_emptied_without_following_symlinks_and_made_0700(
    tmp_path, run_dir, caplog
):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("x")
    private_folder_with_our_records(run_dir)
    os.symlink(elsewhere, os.path.join(run_dir, "stacks", "link"))
    os.symlink(elsewhere, os.path.join(run_dir, "operators-link"))  # not the runtime's: stays
    with open(os.path.join(run_dir, "operators-notes"), "w") as notes:
        notes.write("kept")
    os.chmod(run_dir, 0o777)
    with caplog.at_level(logging.WARNING, logger="mesh.rundir"), rundir.prepare(run_dir):
        assert listing(run_dir) == {rundir.LOCK_NAME, "operators-link", "operators-notes"}
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    said = "not trusted: the folder was writable by others (mode 0777); removing the runtime's entries"
    assert said in caplog.text
    assert listing(str(elsewhere)) == {"precious"}


def test_a_private_folder_whose_contents_are_ours_and_private_is_kept(run_dir, caplog):
    private_folder_with_our_records(run_dir)
    before = listing(run_dir)
    with caplog.at_level(logging.WARNING, logger="mesh.rundir"), rundir.prepare(run_dir):
        assert listing(run_dir) == before | {rundir.LOCK_NAME}
    assert "not trusted" not in caplog.text


def test_what_is_not_the_runtimes_in_a_private_folder_neither_counts_nor_goes(tmp_path, run_dir, caplog):
    private_folder_with_our_records(run_dir)
    os.symlink(tmp_path, os.path.join(run_dir, "operators-link"))
    with open(os.path.join(run_dir, "shared-notes"), "w") as notes:
        os.fchmod(notes.fileno(), 0o666)
    before = listing(run_dir)
    with caplog.at_level(logging.WARNING, logger="mesh.rundir"), rundir.prepare(run_dir):
        assert listing(run_dir) == before | {rundir.LOCK_NAME}
    assert "not trusted" not in caplog.text


def test_runtime_socket_path_in_the_folder_is_judged_and_removed_as_the_runtimes(tmp_path, run_dir):
    assert rundir.names_in(run_dir, os.path.join(run_dir, "grpc.sock"), None, "/elsewhere/x.sock") == (
        "grpc.sock",
    )
    private_folder_with_our_records(run_dir)
    os.symlink(tmp_path, os.path.join(run_dir, "grpc.sock"))  # planted where the front will listen
    with rundir.prepare(run_dir, own=("grpc.sock",)):
        assert "grpc.sock" not in os.listdir(run_dir)
    rundir.remove(run_dir, own=("grpc.sock",))
    assert not os.path.exists(run_dir) and os.path.isdir(tmp_path)


def test_a_lock_file_hard_linked_to_another_file_is_replaced_not_written(tmp_path, run_dir, caplog):
    victim = tmp_path / "victim"
    victim.write_text("do not touch")
    os.chmod(victim, 0o600)
    os.makedirs(run_dir, mode=0o700)
    os.link(victim, os.path.join(run_dir, rundir.LOCK_NAME))
    with caplog.at_level(logging.WARNING, logger="mesh.rundir"), rundir.prepare(run_dir):
        assert victim.read_text() == "do not touch"
    assert "has 2 hard links" in caplog.text


def test_a_socket_others_may_write_to_does_not_make_the_folder_untrusted(run_dir, caplog):
    private_folder_with_our_records(run_dir)
    os.chmod(os.path.join(run_dir, "workers.sock"), 0o775)  # bound under umask 0002
    before = listing(run_dir)
    with caplog.at_level(logging.WARNING, logger="mesh.rundir"), rundir.prepare(run_dir):
        assert listing(run_dir) == before | {rundir.LOCK_NAME}
    assert "not trusted" not in caplog.text


def _plant_symlink(run_dir, elsewhere):
    os.symlink(elsewhere, os.path.join(run_dir, "pids", "102"))
    return "pids/102 is a symlink"


def _plant_writable_file(run_dir, elsewhere):
    path = os.path.join(run_dir, "stacks", "102")
    with open(path, "w"):
        pass
    os.chmod(path, 0o666)
    return "stacks/102 is writable by others (mode 0666)"


def _plant_writable_folder(run_dir, elsewhere):
    os.chmod(os.path.join(run_dir, "pids"), 0o733)
    return "pids is writable by others (mode 0733)"


def _plant_strangers_file(run_dir, elsewhere):
    path = os.path.join(run_dir, "pids", "102")
    with open(path, "w") as f:
        f.write("1.0")
    os.chown(path, STRANGER_UID, STRANGER_UID)
    return f"pids/102 belongs to uid {STRANGER_UID}"


def _plant_strangers_folder(run_dir, elsewhere):
    os.chown(os.path.join(run_dir, "stacks"), STRANGER_UID, STRANGER_UID)
    return f"stacks belongs to uid {STRANGER_UID}"


@pytest.mark.parametrize(
    "plant",
    [
        _plant_symlink,
        _plant_writable_file,
        _plant_writable_folder,
        pytest.param(_plant_strangers_file, marks=needs_root),
        pytest.param(_plant_strangers_folder, marks=needs_root),
    ],
)
def test_a_private_folder_holding_anything_untrusted_is_emptied_and_the_log_names_it(
    plant, tmp_path, run_dir, caplog
):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("x")
    private_folder_with_our_records(run_dir)
    why = plant(run_dir, str(elsewhere))
    with caplog.at_level(logging.WARNING, logger="mesh.rundir"), rundir.prepare(run_dir):
        assert listing(run_dir) == {rundir.LOCK_NAME}
    assert f"not trusted: {os.path.join(run_dir, why)}; removing the runtime's entries" in caplog.text
    assert listing(str(elsewhere)) == {"precious"}


def test_a_planted_lock_symlink_is_replaced_not_followed(tmp_path, run_dir, caplog):
    victim = tmp_path / "victim"
    victim.write_text("do not touch")
    os.makedirs(run_dir, mode=0o700)
    os.symlink(victim, os.path.join(run_dir, rundir.LOCK_NAME))
    os.chmod(run_dir, 0o777)
    with caplog.at_level(logging.WARNING, logger="mesh.rundir"), rundir.prepare(run_dir):
        lock_path = os.path.join(run_dir, rundir.LOCK_NAME)
        assert stat.S_ISREG(os.lstat(lock_path).st_mode)
        with open(lock_path) as lock_file:
            assert lock_file.read().strip() == str(os.getpid())
    assert victim.read_text() == "do not touch"
    assert "is a symlink; replacing it" in caplog.text


# -- titles and the purge ------------------------------------------------------------


def test_a_process_that_cannot_be_recorded_costs_a_warning_not_the_process(run_dir, caplog):
    registry = ProcessRegistry(run_dir)
    shutil.rmtree(registry.folder)
    open(registry.folder, "w").close()  # where the records go, a file: every record fails
    registry.add(os.getpid())
    assert f"pid {os.getpid()} is not recorded" in caplog.text


def test_a_title_names_its_runtime_dir_last_so_a_model_id_cannot_claim_another():
    assert titles.title("worker spare", "/run/a") == "mesh-runtime worker spare dir=/run/a"
    assert titles.is_runtime_process_of(["mesh-runtime forkserver dir=/run/a", "", ""], "/run/a")
    assert not titles.is_runtime_process_of(["mesh-runtime forkserver dir=/run/a"], "/run/b")
    assert not titles.is_runtime_process_of(["mesh-runtime forkserver dir=/run/ab"], "/run/a")
    assert not titles.is_runtime_process_of([titles.title("worker model=m dir=/run/b", "/run/a")], "/run/b")
    assert not titles.is_runtime_process_of(
        ["python", "-c", "mesh-runtime worker spare dir=/run/a"], "/run/a"
    )
    assert not titles.is_runtime_process_of(["mesh-runtime worker spare"], "")


def test_setting_a_title_the_os_refuses_returns_false_and_logs_instead_of_raising(caplog):
    with caplog.at_level(logging.WARNING, logger="mesh.titles"):
        assert titles.set_title("worker model=bad\0id") is False
    assert "cannot set the process title" in caplog.text


def test_purge_kills_a_recorded_mesh_runtime_process_of_this_runtime_dir(run_dir, caplog):
    os.makedirs(run_dir, mode=0o700)
    child = start_titled(titles.title("worker model=m", run_dir))
    try:
        record(run_dir, child)
        registry = ProcessRegistry(run_dir)
        with open(os.path.join(run_dir, "stacks", str(child.pid)), "w") as dump:
            dump.write("its stacks, dumped on SIGUSR1")
        os.makedirs(os.path.join(run_dir, "stacks", "not-a-dump", "inside"))  # no front makes one
        os.mkdir(os.path.join(run_dir, "pids", "not-a-record"))
        with caplog.at_level(logging.WARNING, logger="mesh.leftovers"):
            assert registry.purge() == [child.pid]
        assert child.wait(5) == -signal.SIGKILL
        assert f"killing pid {child.pid}, left behind by an earlier runtime" in caplog.text
        assert os.listdir(os.path.join(run_dir, "pids")) == []
        assert os.listdir(os.path.join(run_dir, "stacks")) == []  # its folders are the runtime's
    finally:
        end(child)


@pytest.mark.parametrize("kind", ["no mesh-runtime title", "title of another folder"])
def test_purge_leaves_a_recorded_process_of_ours_that_is_not_a_mesh_runtime_process_of_this_dir(
    kind, run_dir, caplog
):
    os.makedirs(run_dir, mode=0o700)
    child = (
        start_sleeper()
        if kind == "no mesh-runtime title"
        else start_titled(titles.title("worker spare", run_dir + "-other"))
    )
    try:
        record(run_dir, child)
        with caplog.at_level(logging.WARNING, logger="mesh.leftovers"):
            assert ProcessRegistry(run_dir).purge() == []
        assert child.poll() is None
        assert f"leaving pid {child.pid} alone: its title" in caplog.text
        assert f"does not mark it as a mesh-runtime process of {run_dir}" in caplog.text
    finally:
        end(child)


@needs_root
def test_purge_leaves_a_recorded_process_of_another_uid_even_with_our_title(run_dir, caplog):
    os.makedirs(run_dir, mode=0o700)
    stranger = start_strangers_titled(titles.title("worker spare", run_dir))
    try:
        record(run_dir, stranger)
        with caplog.at_level(logging.WARNING, logger="mesh.leftovers"):
            assert ProcessRegistry(run_dir).purge() == []
        assert stranger.poll() is None
        assert (
            f"leaving pid {stranger.pid} alone: it runs as uid {STRANGER_UID}, not as the runtime's uid 0"
            in caplog.text
        )
    finally:
        end(stranger)


# -- real fronts ---------------------------------------------------------------------


def _run_until_it_exits(rt: Runtime, timeout: float = 30) -> tuple[int, str]:
    rt.start(wait_ready=False)
    try:
        return rt.process.wait(timeout), rt.log()
    finally:
        rt.stop()


@needs_root
def test_a_front_leaves_a_planted_record_of_another_uids_process_alone_and_says_why():
    rt = Runtime()
    run_dir = rt.env["RUNTIME_DIR"]
    os.makedirs(run_dir, mode=0o700)
    stranger = start_sleeper(user=STRANGER_UID)
    try:
        record(run_dir, stranger)
        rt.start()
        assert stranger.poll() is None
        assert f"leaving pid {stranger.pid} alone: it runs as uid {STRANGER_UID}" in rt.log()
    finally:
        rt.stop()
        end(stranger)


def test_a_front_empties_a_loose_runtime_dir_kills_nothing_planted_and_makes_it_0700(tmp_path):
    rt = Runtime()
    run_dir = rt.env["RUNTIME_DIR"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("x")
    private_folder_with_our_records(run_dir)
    os.symlink(elsewhere, os.path.join(run_dir, "stacks", "link"))
    os.chmod(run_dir, 0o777)
    # Recorded and titled like one of this folder's workers: only the loose mode gives it away.
    planted = start_titled(titles.title("worker spare", run_dir))
    try:
        record(run_dir, planted)
        rt.start()
        assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
        assert planted.poll() is None
        assert "the folder was writable by others (mode 0777); removing the runtime's entries" in rt.log()
        assert "killing pid" not in rt.log()
        assert "101" not in os.listdir(os.path.join(run_dir, "pids"))
        assert listing(str(elsewhere)) == {"precious"}
    finally:
        rt.stop()
        end(planted)


def test_a_stop_removes_what_the_front_made_in_a_given_folder_and_keeps_the_rest():
    rt = Runtime(MODELS_PER_WORKER="4")
    run_dir = rt.env["RUNTIME_DIR"]
    os.makedirs(os.path.join(run_dir, "notes"), mode=0o700)
    with open(os.path.join(run_dir, "notes", "todo.txt"), "w") as f:
        f.write("someone's")
    try:
        rt.start()
        rt.load("m", rt.model_dir("m"))
        # rundir.ENTRIES must name all the front makes, or a stop would leave it behind.
        assert set(os.listdir(run_dir)) == {*rundir.ENTRIES, "notes"}
        processes = tree(rt.pid)
        rt.terminate()
        assert rt.process.returncode == 0
        wait_until(lambda: not alive(processes), what="every process to end")
        assert listing(run_dir) == {"notes", "notes/todo.txt"}
        assert f"RUNTIME_DIR {run_dir} kept: it holds files the runtime did not make" in rt.log()
    finally:
        rt.stop()


def test_a_front_on_a_symlinked_runtime_dir_exits_2_and_says_it_is_a_symlink(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = str(tmp_path / "link")
    os.symlink(target, link)
    code, log = _run_until_it_exits(Runtime(RUNTIME_DIR=link))
    assert code == 2 and f"RUNTIME_DIR: {link} is a symlink" in log
    assert os.listdir(target) == []


@needs_root
def test_a_front_on_a_runtime_dir_of_another_uid_exits_2(tmp_path):
    run_dir = str(tmp_path / "theirs")
    os.makedirs(run_dir, mode=0o700)
    os.chown(run_dir, STRANGER_UID, STRANGER_UID)
    code, log = _run_until_it_exits(Runtime(RUNTIME_DIR=run_dir))
    assert code == 2 and f"RUNTIME_DIR: {run_dir} belongs to uid {STRANGER_UID}" in log
    assert os.listdir(run_dir) == []


def test_titles_name_the_runtime_dir():
    with Runtime(WORKERS_WARM="1") as rt:
        rt.load("named", rt.model_dir("named"))
        wait_until(rt.spares, what="the spare the load took to be replaced")
        suffix = f" dir={rt.env['RUNTIME_DIR']}"
        titles = {" ".join(part for part in p.cmdline() if part) for p in tree(rt.pid)}
        assert f"mesh-runtime front port={rt.port}{suffix}" in titles
        assert f"mesh-runtime forkserver base{suffix}" in titles
        assert f"mesh-runtime worker spare{suffix}" in titles
        assert f"mesh-runtime worker model=named{suffix}" in titles


def test_a_second_front_on_the_same_runtime_dir_exits_2_at_once_and_the_first_serves_on():
    with Runtime(WORKERS_WARM="1") as first:
        first.load("first", first.model_dir("first"))
        wait_until(first.spares, what="the spare the load took to be replaced")
        before = sorted(p.pid for p in tree(first.pid))
        second = Runtime(RUNTIME_DIR=first.env["RUNTIME_DIR"])
        started = time.monotonic()
        code, log = _run_until_it_exits(second, timeout=15)
        assert code == 2 and time.monotonic() - started < 15
        assert f"is in use by another front (pid {first.pid})" in log
        assert "killing pid" not in log and "listening on port" not in log
        assert first.infer_fp32("first", [1.0]).outputs
        assert sorted(p.pid for p in alive(tree(first.pid))) == before
        with open(os.path.join(first.env["RUNTIME_DIR"], rundir.LOCK_NAME)) as lock_file:
            assert lock_file.read().strip() == str(first.pid)


@pytest.fixture
def stop_signal_handlers():
    """Puts this process's SIGTERM and SIGINT handlers back after the test."""
    saved = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGINT)}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_a_stop_signal_before_the_loop_listens_stops_it_and_after_the_loop_is_ignored(
    event_loop, stop_signal_handlers
):
    from runtime import server

    stop_signals = server.StopSignals()
    stop_signals.note_early()
    os.kill(os.getpid(), signal.SIGINT)  # without the early handler: KeyboardInterrupt here

    async def listen() -> bool:
        loop = asyncio.get_running_loop()
        try:
            return stop_signals.listen(loop).is_set()
        finally:
            stop_signals.ignore_from_now_on(loop)

    with asyncio.Runner(loop_factory=server.event_loop_factory(event_loop)) as runner:
        assert runner.run(listen()) is True
    assert signal.getsignal(signal.SIGINT) == signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGINT)  # the default handler would raise KeyboardInterrupt


def processes_of(run_dir: str) -> list[psutil.Process]:
    """Every running process whose title names run_dir."""
    found = []
    for process in psutil.process_iter():
        try:
            if titles.is_runtime_process_of(process.cmdline(), run_dir):
                found.append(process)
        except psutil.Error:
            pass
    return alive(found)


def _sigint_until_it_exits(rt: Runtime) -> int:
    """SIGINT every few milliseconds until the front exits: some land after its shutdown."""
    sent = 0
    while rt.process.poll() is None:
        try:
            rt.process.send_signal(signal.SIGINT)
            sent += 1
        except ProcessLookupError:
            break
        time.sleep(0.005)
    assert sent > 1
    return rt.process.wait(30)


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
@pytest.mark.parametrize("when", ["serving", "starting"])
def test_any_number_of_sigints_end_in_a_clean_exit_0_with_every_process_reaped(event_loop, when):
    rt = Runtime(EVENT_LOOP=event_loop, WORKERS_WARM="1")
    try:
        if when == "serving":
            rt.start()
            rt.load("m", rt.model_dir("m"))
        else:  # from the moment the front has titled itself, before it listens
            rt.start(wait_ready=False)
            wait_until(
                lambda: "mesh-runtime front" in " ".join(psutil.Process(rt.pid).cmdline()),
                what="the front's title",
            )
        processes = tree(rt.pid)
        assert _sigint_until_it_exits(rt) == 0, rt.log()
        wait_until(
            lambda: not alive(processes) and not processes_of(rt.env["RUNTIME_DIR"]),
            timeout=10,
            what="every process of the front to end",
        )
        assert "stopped; every worker reaped" in rt.log()
        assert not os.path.exists(rt.env["RUNTIME_DIR"])
    finally:
        rt.stop()


def _blocks_sigterm(pid: int) -> bool:
    """Whether the process's main thread holds SIGTERM back (its SigBlk mask in /proc)."""
    with open(f"/proc/{pid}/status") as status:
        masks = dict(line.split(":\t", 1) for line in status if line.startswith("SigBlk"))
    return bool(int(masks["SigBlk"], 16) & (1 << (signal.SIGTERM - 1)))


def test_a_sigterm_while_the_front_imports_stops_it_once_started_with_exit_0():
    rt = Runtime(WORKERS_WARM="1")
    try:
        rt.start(wait_ready=False)
        wait_until(lambda: _blocks_sigterm(rt.pid), interval=0.001, what="the imports under way")
        rt.process.send_signal(signal.SIGTERM)  # without the mask: exit -15, nothing cleaned
        assert rt.process.wait(30) == 0, rt.log()
        assert "SIGTERM came during startup: stopping once started" in rt.log()
        assert not os.path.exists(rt.env["RUNTIME_DIR"])
    finally:
        rt.stop()


def test_a_front_listening_inside_a_loose_runtime_dir_removes_what_was_planted_where_it_listens(tmp_path):
    elsewhere = tmp_path / "elsewhere.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as planted:
        planted.bind(str(elsewhere))
        planted.listen()  # something answers there: taken for a front, the start would fail
        rt = Runtime()
        run_dir = rt.env["RUNTIME_DIR"]
        path = os.path.join(run_dir, "grpc.sock")
        os.makedirs(run_dir, mode=0o700)
        os.symlink(elsewhere, path)
        os.chmod(run_dir, 0o777)
        try:
            rt.env["RUNTIME_SOCKET_PATH"] = path
            rt.start()
            assert stat.S_ISSOCK(os.lstat(path).st_mode)  # the front's own now
            rt.terminate()
            assert rt.process.returncode == 0 and not os.path.exists(run_dir)
        finally:
            rt.stop()
