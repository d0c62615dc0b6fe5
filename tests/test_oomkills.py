"""A worker the kernel's OOM killer ends is reported as out of memory, not as a bare SIGKILL."""

from __future__ import annotations

import os

import grpc
import pytest
from harness import Runtime, expect_status, wait_until

from runtime import oomkills
from runtime.worker import OUT_OF_MEMORY


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_the_count_of_a_v2_cgroup_is_read_and_a_rise_seen_once(tmp_path):
    events = tmp_path / "root" / "kubepods" / "pod1" / "memory.events"
    _write(events, "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\noom_group_kill 0\n")
    _write(tmp_path / "self", "0::/kubepods/pod1\n")
    kills = oomkills.OomKills(str(tmp_path / "self"), str(tmp_path / "root"))
    assert kills.path == str(events)
    assert not kills.claim(True)
    _write(events, "low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert kills.claim(True) and not kills.claim(True)


def test_each_kill_is_put_down_to_one_worker_killed_by_no_one_else(tmp_path):
    events = tmp_path / "root" / "memory.events"
    _write(events, "oom_kill 0\n")
    _write(tmp_path / "self", "0::/\n")
    kills = oomkills.OomKills(str(tmp_path / "self"), str(tmp_path / "root"))
    _write(events, "oom_kill 2\n")  # two workers killed together, reaped one after the other
    assert kills.claim(True) and kills.claim(True) and not kills.claim(True)
    _write(events, "oom_kill 3\n")  # a worker the front killed is reaped before the one killed for memory
    assert not kills.claim(False) and kills.claim(True)


def test_a_v1_memory_cgroup_is_found_among_the_other_controllers(tmp_path):
    control = tmp_path / "root" / "memory" / "a" / "b" / "memory.oom_control"
    _write(control, "oom_kill_disable 0\nunder_oom 0\noom_kill 7\n")
    _write(tmp_path / "self", "5:pids:/a/b\n4:memory:/a/b\n1:cpu,cpuacct:/a\n0::/\n")
    assert oomkills.counter_path(str(tmp_path / "self"), str(tmp_path / "root")) == str(control)
    assert oomkills.read_count(str(control)) == 7


def test_without_a_readable_cgroup_count_the_machines_is_read(tmp_path):
    _write(tmp_path / "self", "0::/gone\n")
    assert oomkills.counter_path(str(tmp_path / "self"), str(tmp_path)) == oomkills.MACHINE_COUNT
    assert oomkills.counter_path(str(tmp_path / "no-such-file")) == oomkills.MACHINE_COUNT
    assert oomkills.read_count(str(tmp_path / "self")) is None


# Touches a page at a time until the cgroup's limit stops it.
HOG_MODEL = """
    import numpy as np

    class Model:
        def __init__(self, path):
            self.held = []

        def predict(self, inputs):
            for _ in range(64):
                self.held.append(np.ones(16 << 20, dtype=np.uint8))
            return dict(inputs)
"""


def _limit_memory(meter, limit: int) -> None:
    name = "memory.max" if meter.usage_file.endswith("memory.current") else "memory.limit_in_bytes"
    with open(os.path.join(meter.path, name), "w") as f:
        f.write(str(limit))


def test_a_worker_the_oom_killer_ends_is_said_to_be_out_of_memory(meter):
    if meter.path is None:
        pytest.skip(f"no memory cgroup: {meter.method}")
    with Runtime(command_prefix=meter.command_prefix()) as rt:
        rt.load("hog", rt.model_dir("hog", HOG_MODEL))
        _limit_memory(meter, meter.usage() + (256 << 20))
        error = expect_status(grpc.StatusCode.UNAVAILABLE, rt.infer_fp32, "hog", [1.0])
        assert OUT_OF_MEMORY in error.details(), error.details()
        wait_until(lambda: f"died ({OUT_OF_MEMORY}); healing" in rt.log(), what="the heal's log line")
        assert rt.pid is not None and rt.process.poll() is None, "the front lives on"
