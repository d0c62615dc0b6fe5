"""The pool forks no worker that would bring the pids cgroup within a reserve of its pids.max: the load
is refused instead, and the fork server, which a failed fork kills with all its workers, lives on.

Unit tests of runtime/tasklimit.py on cgroup trees written under tmp_path, then a real front
(tests/harness.Runtime) in a pids cgroup of its own, where one can be made.
"""

import os
import time

import grpc
import pytest
from harness import REPO, Runtime, expect_status, status_of, wait_until
from test_cpu_quota import self_cgroup

from meshtest import cgroup
from runtime import tasklimit


def write_tree(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_tightest_limit_of_the_cgroup_and_those_above_it_counts_v2(tmp_path):
    root = tmp_path / "cg"
    write_tree(root, {"pod/pids.max": "100\n", "pod/pids.current": "90\n"})
    write_tree(root, {"pod/c/pids.max": "max\n", "pod/c/pids.current": "90\n"})
    cgroup_file = self_cgroup(tmp_path, "0::/pod/c\n")
    assert tasklimit.tasks_left(str(root), cgroup_file) == 10
    assert not tasklimit.room_for_a_worker(str(root), cgroup_file)
    write_tree(root, {"pod/pids.current": "20\n"})
    assert tasklimit.room_for_a_worker(str(root), cgroup_file)


def test_workers_on_their_way_count_as_if_their_tasks_had_started(tmp_path):
    root = tmp_path / "cg"
    write_tree(root, {"pod/pids.max": "100\n", "pod/pids.current": "75\n"})  # 25 left
    cgroup_file = self_cgroup(tmp_path, "0::/pod\n")
    assert tasklimit.room_for_a_worker(str(root), cgroup_file, starting=2)  # 3 x 3 + 16
    assert not tasklimit.room_for_a_worker(str(root), cgroup_file, starting=3)


def test_v1_and_a_container_that_sees_only_its_own_cgroup(tmp_path):
    root = tmp_path / "cg"
    # The path /proc/self/cgroup names is not there: the hierarchy's top is the container's cgroup.
    write_tree(root, {"pids/pids.max": "50\n", "pids/pids.current": "40\n"})
    cgroup_file = self_cgroup(tmp_path, "5:memory:/kubepods/x\n4:pids:/kubepods/x\nnot a cgroup line\n")
    assert tasklimit.tasks_left(str(root), cgroup_file) == 10
    assert not tasklimit.room_for_a_worker(str(root), cgroup_file)


def test_no_limit_or_nothing_readable_leaves_room(tmp_path):
    root = tmp_path / "cg"
    write_tree(root, {"pids/pids.max": "max\n", "pids/pids.current": "40\n"})
    assert tasklimit.tasks_left(str(root), self_cgroup(tmp_path, "4:pids:/\n")) is None
    assert tasklimit.room_for_a_worker(str(root), self_cgroup(tmp_path, "4:pids:/\n"))
    assert tasklimit.room_for_a_worker(str(root), str(tmp_path / "no-such-file"))


def test_a_shortage_is_told_only_near_the_limit(tmp_path):
    root = tmp_path / "cg"
    write_tree(root, {"pids/pids.max": "30\n", "pids/pids.current": "28\n"})
    cgroup_file = self_cgroup(tmp_path, "4:pids:/\n")
    told = tasklimit.shortage(str(root), cgroup_file)
    assert told is not None and told.startswith("2 tasks left under the pids cgroup's pids.max")
    write_tree(root, {"pids/pids.max": "300\n"})
    assert tasklimit.shortage(str(root), cgroup_file) is None


def test_a_pids_limit_too_low_for_the_start_is_named_in_one_line():
    path, why = cgroup.make("start", "pids", "/sys/fs/cgroup/pids")
    if path is None:
        pytest.skip(f"no pids cgroup can be made here: {why}")
    with open(os.path.join(path, "pids.max"), "w") as limit:
        limit.write("12")  # fewer than the front's own threads and a fork server
    joins = cgroup.Cgroup()
    joins.path = path
    rt = Runtime(command_prefix=joins.command_prefix())
    try:
        rt.start(wait_ready=False)
        assert rt.process.wait(60) == 1
        log = rt.log()
        assert (
            "tasks left under the pids cgroup's pids.max" in log and "raise the container's pids limit" in log
        )
        assert "Traceback" not in log, log
    finally:
        rt.stop()
        joins.remove()


def test_a_load_past_pids_max_is_refused_and_the_models_loaded_keep_their_workers():
    path, why = cgroup.make("tasks", "pids", "/sys/fs/cgroup/pids")
    if path is None:
        pytest.skip(f"no pids cgroup can be made here: {why}")
    joins = cgroup.Cgroup()
    joins.path = path
    try:
        with Runtime(command_prefix=joins.command_prefix()) as rt:
            rt.settled_uss()
            with open(os.path.join(path, "pids.current")) as current:
                tasks = int(current.read())
            with open(os.path.join(path, "pids.max"), "w") as limit:
                limit.write(str(tasks + 1))  # the spare there may be taken; no other worker fits
            folder = rt.model_dir("echo")
            rt.load("first", folder)
            error = expect_status(grpc.StatusCode.RESOURCE_EXHAUSTED, rt.load, "second", folder)
            assert "pids.max" in error.details()
            time.sleep(2)  # a fork server killed by a failed fork would have taken "first" with it
            assert rt.infer_fp32("first", [1.0]).outputs[0].name == "x"
            with open(os.path.join(path, "pids.max"), "w") as limit:
                limit.write("max")
            rt.load("second", folder)
            assert rt.infer_fp32("second", [1.0]).outputs[0].name == "x"
            log = rt.log()
        assert "fork server died" not in log and "healing" not in log, log
    finally:
        joins.remove()


def test_a_fork_the_kernel_refuses_fails_that_start_alone_and_the_fork_server_lives_on(tmp_path):
    # A limit the front cannot see (a pod's pids.max above the container's own cgroup): the fork
    # server's fork fails with EAGAIN.
    refuse = tmp_path / "refuse-forks"
    meshtest = os.path.join(REPO, "meshtest")
    env = {"WORKER_PRELOAD": "numpy,fork_fails", "PYTHONPATH": meshtest, "MESH_TEST_FORK_FAILS": str(refuse)}
    with Runtime(WORKERS_WARM="1", **env) as rt:
        folder = rt.model_dir("echo")
        rt.load("first", folder)
        rt.settled_uss()  # the spare "first" took is replaced before forks are refused
        forkserver = rt.forkservers()[0].pid
        refuse.touch()
        rt.load("second", folder)  # takes the spare; its refill is refused
        error = expect_status(grpc.StatusCode.UNAVAILABLE, rt.load, "third", folder)
        assert "did not start" in error.details()
        assert rt.infer_fp32("first", [1.0]).outputs[0].name == "x"
        assert [p.pid for p in rt.forkservers()] == [forkserver]
        refuse.unlink()
        wait_until(lambda: status_of(rt.load, "third", folder) == grpc.StatusCode.OK, timeout=40)
        assert rt.infer_fp32("third", [1.0]).outputs[0].name == "x"
        log = rt.log()
    assert "cannot fork a worker: [Errno 11]" in log, log
    assert "fork server died" not in log and "healing" not in log, log


def test_a_model_whose_heal_finds_no_worker_serves_on_its_other_replicas_and_heals_later(tmp_path):
    refuse = tmp_path / "refuse-forks"
    meshtest = os.path.join(REPO, "meshtest")
    env = {"WORKER_PRELOAD": "numpy,fork_fails", "PYTHONPATH": meshtest, "MESH_TEST_FORK_FAILS": str(refuse)}
    with Runtime(WORKERS_WARM="0", MODEL_REPLICAS="2", **env) as rt:
        rt.load("twice", rt.model_dir("twice"))

        def replicas():
            return [p for p in rt.workers() if "model=twice" in " ".join(p.cmdline())]

        assert len(replicas()) == 2
        refuse.touch()
        replicas()[0].kill()
        wait_until(
            lambda: "twice serves on 1 of its 2 replicas" in rt.log(), timeout=20, what="the heal to give up"
        )
        assert "dropping twice" not in rt.log()
        assert rt.infer_fp32("twice", [1.0]).outputs[0].name == "x"
        refuse.unlink()
        wait_until(lambda: len(replicas()) == 2, timeout=30, what="the second replica to heal")
        assert rt.infer_fp32("twice", [1.0]).outputs[0].name == "x"
