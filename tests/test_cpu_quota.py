"""runtime/busypoll.py under a CPU quota: polling is off unless set, and a window set under a
quota is logged as drawing on the workers' CPU.

The quota is read from a cgroup tree written under tmp_path (v2 cpu.max, v1
cpu.cfs_quota_us), and once end to end: a front started in a real cgroup of
one core (bench/cpulimit.py's, as root) says so in its log.
"""

from __future__ import annotations

import os

import pytest
from harness import Runtime

from bench.cpulimit import CpuQuota
from runtime import busypoll
from runtime.settings import Settings


def write(path, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def self_cgroup(tmp_path, text: str) -> str:
    path = tmp_path / "self-cgroup"
    path.write_text(text)
    return str(path)


def test_v2_a_quota_above_the_process_counts_and_max_means_none(tmp_path):
    root = tmp_path / "fs"
    write(root / "kubepods" / "cpu.max", "150000 100000\n")
    write(root / "kubepods" / "pod" / "cpu.max", "max 100000\n")
    cgroup = self_cgroup(tmp_path, "0::/kubepods/pod\n")
    assert busypoll.cpu_quota_cores(str(root), cgroup) == 1.5
    assert busypoll.cpu_quota_cores(str(root), self_cgroup(tmp_path, "0::/elsewhere\n")) is None


def test_v1_the_tightest_quota_of_the_cpu_hierarchy_counts(tmp_path):
    root = tmp_path / "fs"
    for folder, quota in (("cpu,cpuacct", "-1"), ("cpu,cpuacct/pod", "50000"), ("cpu,cpuacct/pod/c", "-1")):
        write(root / folder / "cpu.cfs_quota_us", quota)
        write(root / folder / "cpu.cfs_period_us", "100000")
    cgroup = self_cgroup(tmp_path, "4:memory:/pod/c\n3:cpu,cpuacct:/pod/c\n0::/\nnot a cgroup line\n")
    assert busypoll.cpu_quota_cores(str(root), cgroup) == 0.5


def test_polling_is_off_unless_set_and_a_window_under_a_quota_is_called_out(monkeypatch):
    monkeypatch.setattr(busypoll, "cpu_quota_cores", lambda root=None: None)
    assert Settings.from_env({}).busy_poll_us == 0
    assert Settings.from_env({"BUSY_POLL_US": "500"}).busy_poll_us == 500
    assert busypoll.describe(0) == "off"
    assert busypoll.describe(500) == "up to 500 µs after each request"
    monkeypatch.setattr(busypoll, "cpu_quota_cores", lambda root=None: 1.0)
    assert busypoll.describe(0) == "off"
    assert busypoll.describe(500).startswith("up to 500 µs after each request, under a CPU quota of 1 core:")


def test_a_front_started_in_a_cgroup_of_one_core_logs_the_quota_its_polling_draws_on():
    quota = CpuQuota("test")
    if quota.path is None:
        pytest.skip(f"no CPU cgroup can be made here: {quota.why_not}")
    try:
        with Runtime(command_prefix=quota.command_prefix()) as rt:
            assert "busy polling off" in rt.log()
        with Runtime(command_prefix=quota.command_prefix(), BUSY_POLL_US="1000") as rt:
            assert "busy polling up to 1000 µs after each request, under a CPU quota of 1 core" in rt.log()
        with Runtime(BUSY_POLL_US="1000") as rt:
            own = busypoll.cpu_quota_cores()  # where the tests themselves run under a quota
            assert "busy polling up to 1000 µs after each request" + ("," if own else "\n") in rt.log()
    finally:
        quota.remove()
