"""scripts/demo, run as a user would (its body, scripts/demo.py, with the venv already made)."""

import os
import re
import subprocess
import sys

import psutil
import pytest
from harness import REPO

sys.path.insert(0, os.path.join(REPO, "scripts"))
import make_examples  # noqa: E402  (scripts/make_examples.py)

DEMO_TIMEOUT = 120  # the demo takes under a minute once installed; this is a hang guard


def in_session(session: int) -> list[psutil.Process]:
    """Processes of that session still running (zombies hold nothing and count as gone)."""
    found = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (OSError, psutil.Error):
            pass
    return found


@pytest.fixture(scope="module")
def demo():
    """-> (exit code, output, processes of the demo's session left afterwards)."""
    # Its own session: whatever the demo starts, however deep, is found by session id.
    process = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "scripts", "demo.py")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=DEMO_TIMEOUT)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return process.returncode, output, in_session(process.pid)


def section(output: str, name: str) -> list[str]:
    """The lines of one section: its title line and the indented lines after it."""
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(name + " "))
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1].strip()), len(lines))
    return lines[start:end]


@pytest.mark.slow  # this test and the next three share one run of the demo: about 10 s
def test_demo_completes(demo):
    code, output, _ = demo
    assert code == 0, output


@pytest.mark.slow
def test_demo_prints_a_prediction_for_every_installed_example(demo):
    _, output, _ = demo
    answers = "\n".join(section(output, "infer"))
    for example in make_examples.EXAMPLES:
        if example.missing():
            assert f"skipped {example.name}: " in output and f"mesh-runtime[{example.extra}]" in output
            continue
        line = re.search(rf"^\s+{example.name}\s+(.*)$", answers, re.MULTILINE)
        assert line, f"no answer from {example.name}:\n{output}"
        first = line.group(1)
        # The setosa then the virginica: labels [0, 2], or probabilities led by 0.9x then ending in 0.9x.
        assert "[0, 2]" in first or re.search(r"\[\[0\.9\d, .*\], \[.*, 0\.9\d\]\]", first), first


@pytest.mark.slow
def test_demo_prints_the_worker_table_and_the_memory_returned(demo):
    _, output, _ = demo
    table = section(output, "workers")
    assert "size reported" in table[0] and "USS measured" in table[0] and "load ms" in table[0]
    installed = [e for e in make_examples.EXAMPLES if not e.missing()]
    rows = [line for line in table if re.match(r"^\s+\d+\s+iris-", line)]
    assert len(rows) == len(installed)
    returned = re.search(r"^memory returned: ([\d.]+) MiB", output, re.MULTILINE)
    assert returned and float(returned.group(1)) > 0, output


@pytest.mark.slow
def test_demo_leaves_no_process(demo):
    _, output, left = demo
    assert not left, f"left running: {[(p.pid, p.name()) for p in left]}"
    assert "no process left" in output


def test_scripts_parse():
    for script in ("demo", "make-examples", "test", "bench", "lint"):
        subprocess.run(["bash", "-n", os.path.join(REPO, "scripts", script)], check=True)
    assert make_examples.main([]) == 2  # usage


def test_bench_prints_its_usage():
    # What scripts/bench runs, without measuring anything.
    done = subprocess.run(
        [sys.executable, "-m", "bench", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: scripts/bench ")
    for flag in (
        "--loads",
        "--json",
        "--skip-dataplane",
        "--dataplane-only",
        "--instructions-only",
        "--rounds",
    ):
        assert flag in done.stdout
    assert "--peer {mlserver}" in done.stdout
