"""bench/instructions.py: reading callgrind's counters.

The valgrind runs themselves are in scripts/bench.
"""

import pytest

from bench import instructions as bench_instructions


def test_counts_come_from_the_dump_of_that_process(tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(bench_instructions.Counted, "_control", lambda self, flag: asked.append(flag))
    (tmp_path / "front.41.1").write_text("events: Ir\nsummary: 123456\n")
    (tmp_path / "front.42.1").write_text("events: Ir\nsummary: 999\n")  # another process
    counted = bench_instructions.Counted(str(tmp_path), "front", 41)
    counted.zero()
    assert counted.instructions_since_zero() == 123456
    assert asked == ["-z", "-d"]


def test_callgrind_control_refusing_is_an_error(tmp_path, monkeypatch):
    class Refused:
        stdout, stderr = "Error: Callgrind task with PID/name '7' not detected.", ""

    monkeypatch.setattr(bench_instructions.subprocess, "run", lambda *args, **kwargs: Refused())
    with pytest.raises(RuntimeError, match="not detected"):
        bench_instructions.Counted(str(tmp_path), "front", 7).zero()
