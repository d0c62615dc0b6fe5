"""Operators' tools against a live runtime: inspect-workers, worker-stacks, kill-worker, metrics, logs."""

import json
import os
import subprocess
import threading
import time

import grpc
import pytest
from harness import (
    REPO,
    Runtime,
    alive,
    expect_status,
    free_port,
    mesh_headers,
    metric_sample,
    scrape_metrics,
    wait_until,
)

from protos import grpc_predict_v2_pb2 as v2

# predict blocks while the file "hold" exists in its folder.
HELD = """
    import os, time
    import numpy as np

    class Model:
        def __init__(self, path):
            self.path = path
            slow_reload = os.path.exists(os.path.join(path, "slow-reload"))
            if slow_reload and os.path.exists(os.path.join(path, "loaded-once")):
                while os.path.exists(os.path.join(path, "slow-reload")):
                    time.sleep(0.01)
            open(os.path.join(path, "loaded-once"), "w").close()

        def predict(self, inputs):
            while os.path.exists(os.path.join(self.path, "hold")):
                time.sleep(0.01)
            return {"ok": np.array([1], dtype=np.int32)}
"""


def script(name, *args, env=None):
    return subprocess.run(
        [os.path.join(REPO, "scripts", name), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def ops():
    port = free_port()
    with Runtime(METRICS_PORT=str(port), MODEL_REPLICAS="2", WORKERS_WARM="2") as runtime:
        yield runtime


def rd(runtime):
    return ["--runtime-dir", runtime.env["RUNTIME_DIR"]]


def test_inspect_workers_table_json_and_healthy_exit(ops):
    ops.load("table-model", ops.model_dir("table-model", HELD))
    done = script("inspect-workers", *rd(ops))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:4] == ["PID", "ROLE", "MODEL", "STATE"]
    model_rows = [line for line in lines if " table-model " in line]
    assert len(model_rows) == 2 and all(" serving " in line for line in model_rows)
    assert any(" spare " in line for line in lines[1:])
    parsed = json.loads(script("inspect-workers", "--json", *rd(ops)).stdout)
    pids = {row["pid"] for row in parsed["workers"] if row["model"] == "table-model"}
    assert pids == {p.pid for p in ops.workers() if "model=table-model" in " ".join(p.cmdline())}
    assert {"uss_bytes", "rss_bytes", "cpu_percent", "in_flight", "served", "errors"} <= set(
        parsed["workers"][0]
    )
    ops.unload("table-model")


def test_inspect_workers_degraded_exit_1_while_a_model_heals(ops):
    path = ops.model_dir("healing-model", HELD)
    ops.load("healing-model", path)
    open(os.path.join(path, "slow-reload"), "w").close()
    victim = ops.worker_for("healing-model")
    victim.kill()
    wait_until(lambda: script("inspect-workers", *rd(ops)).returncode == 1, what="exit code 1 (degraded)")
    assert (
        "degraded: healing-model has 1/2 replicas ready (healing)"
        in script("inspect-workers", *rd(ops)).stdout
    )
    os.unlink(os.path.join(path, "slow-reload"))
    wait_until(lambda: script("inspect-workers", *rd(ops)).returncode == 0, what="healed")
    ops.unload("healing-model")


def _inspect_unreachable(runtime) -> tuple[subprocess.CompletedProcess, dict[int, list[str]]]:
    """inspect-workers with the runtime's admin socket out of its place (and the folder named with
    a trailing slash); its rows by pid."""
    socket = os.path.join(runtime.env["RUNTIME_DIR"], "admin.sock")
    os.rename(socket, socket + ".away")  # still bound: the front answers whoever finds it
    try:
        done = script("inspect-workers", "--runtime-dir", runtime.env["RUNTIME_DIR"] + "/")
    finally:
        os.rename(socket + ".away", socket)
    return done, {int(line.split()[0]): line.split()[1:3] for line in done.stdout.splitlines()[1:]}


def test_inspect_workers_unreachable_exit_2_with_degraded_mode(ops):
    ops.load("degraded-model", ops.model_dir("degraded-model", HELD))
    with Runtime(MODELS_PER_WORKER="4") as other:  # its processes must not show among ops's
        other.load("packed", other.model_dir("packed"))
        done, rows = _inspect_unreachable(ops)
        assert done.returncode == 2
        assert "degraded mode" in done.stderr and "process title" in done.stderr
        spares = {p.pid for p in ops.spares()}
        assert rows == {
            p.pid: ["spare", "-"] if p.pid in spares else ["model", "degraded-model"] for p in ops.workers()
        }
        done, rows = _inspect_unreachable(other)
        (pack,) = other.packs()
        assert done.returncode == 2 and rows[pack.pid] == ["pack", "models=1"]
    ops.unload("degraded-model")


def test_inspect_workers_watch_interrupted_before_its_first_answer_exits_2(monkeypatch, tmp_path):
    from runtime.admin import cli

    def interrupted(runtime_dir, as_json):  # Ctrl-C while a silent front keeps the first look waiting
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_inspect_once", interrupted)
    assert cli.inspect_workers(["--watch", "1", "--runtime-dir", str(tmp_path)]) == cli.UNREACHABLE


@pytest.mark.parametrize("period", ["-1", "nan", "inf"])
def test_inspect_workers_refuses_a_watch_period_it_cannot_sleep(period, tmp_path):
    done = script("inspect-workers", "--runtime-dir", str(tmp_path), f"--watch={period}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"--watch: expected a number of seconds, 0 or more, got '{period}'" in done.stderr


def test_worker_stacks_show_predict_while_busy(ops):
    path = ops.model_dir("busy-model", HELD)
    ops.load("busy-model", path)
    open(os.path.join(path, "hold"), "w").close()
    call = threading.Thread(
        target=lambda: ops.infer.ModelInfer(v2.ModelInferRequest(model_name="busy-model"), timeout=30)
    )
    call.start()
    try:
        time.sleep(0.5)
        done = script("worker-stacks", "busy-model", *rd(ops))
        assert done.returncode == 0, done.stderr
        assert "in predict" in done.stdout and "model.py" in done.stdout
        assert done.stdout.count("== worker ") == 2
    finally:
        os.unlink(os.path.join(path, "hold"))
        call.join(30)
    ops.unload("busy-model")


def test_kill_worker_kills_and_the_model_heals(ops):
    ops.load("kill-model", ops.model_dir("kill-model", HELD))
    victim = ops.worker_for("kill-model")
    done = script("kill-worker", str(victim.pid), *rd(ops))
    assert done.returncode == 0 and f"killed {victim.pid}" in done.stdout
    wait_until(lambda: not alive([victim]), what="the worker to die")
    wait_until(
        lambda: len([p for p in ops.workers() if "model=kill-model" in " ".join(p.cmdline())]) == 2,
        what="the model to heal",
    )
    assert script("kill-worker", "no-such-model", *rd(ops)).returncode == 1
    ops.unload("kill-model")


def test_metrics_after_traffic(ops):
    ops.load("metered", ops.model_dir("metered", HELD))
    for _ in range(3):
        ops.infer.ModelInfer(v2.ModelInferRequest(model_name="metered"), metadata=mesh_headers("metered"))
    bad = v2.ModelInferRequest(model_name="metered")
    bad.inputs.add(name="x", datatype="NOPE", shape=[1])
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, ops.infer.ModelInfer, bad)
    text = scrape_metrics(ops)
    calls = {"model": "metered", "method": "ModelInfer"}
    assert metric_sample(text, "mesh_requests_total", code="OK", **calls) == 3
    assert metric_sample(text, "mesh_requests_total", code="INVALID_ARGUMENT", **calls) == 1
    assert metric_sample(text, "mesh_request_seconds_count", **calls) == 4
    assert metric_sample(text, "mesh_loads_total", outcome="ok") >= 1
    assert metric_sample(text, "mesh_load_seconds_count", outcome="ok") >= 1
    assert metric_sample(text, "mesh_model_memory_bytes", model="metered") > 1_000_000
    assert metric_sample(text, "mesh_model_ready_replicas", model="metered") == 2
    assert metric_sample(text, "mesh_queue_depth", model="metered") == 0
    assert metric_sample(text, "mesh_capacity_bytes") > metric_sample(text, "mesh_capacity_used_bytes") > 0
    assert metric_sample(text, "mesh_warm_spares") >= 0
    ops.unload("metered")
    text = scrape_metrics(ops)
    assert 'model="metered"' not in text, "an unloaded model's series stayed"
    assert metric_sample(text, "mesh_unloads_total") >= 1


def sample_or_zero(text, name, **labels):
    try:
        return metric_sample(text, name, **labels)
    except AssertionError:  # no such series yet
        return 0.0


def test_failed_and_refused_loads_count_as_failed_and_not_as_unloads(ops):
    before = scrape_metrics(ops)
    folder = ops.model_dir("raises-at-load", "class Model:\n    def __init__(self, path):\n        1 / 0\n")
    expect_status(grpc.StatusCode.FAILED_PRECONDITION, ops.load, "raises-at-load", folder)
    # Refused before any worker is touched: a path that is not there, a format nobody knows.
    missing = os.path.join(ops.models, "not-pulled")
    expect_status(grpc.StatusCode.FAILED_PRECONDITION, ops.load, "not-pulled", missing)
    expect_status(grpc.StatusCode.INVALID_ARGUMENT, ops.load, "no-format", folder, fmt="nope")
    after = scrape_metrics(ops)
    failed = [sample_or_zero(text, "mesh_loads_total", outcome="failed") for text in (before, after)]
    assert failed[1] == failed[0] + 3
    assert sample_or_zero(after, "mesh_unloads_total") == sample_or_zero(before, "mesh_unloads_total")


# Writes as model code does: print(), a warning, stderr.
PRINTING = """
    import sys, warnings
    import numpy as np

    print("printed at load")
    warnings.warn("warned at load")

    class Model:
        def __init__(self, path):
            pass

        def predict(self, inputs):
            sys.stderr.write("written to stderr\\n")
            return {"y": np.array([1.0], dtype=np.float32)}
"""


def test_json_logs_one_object_per_line_with_model_id():
    with Runtime(LOG_FORMAT="json") as runtime:
        runtime.load("logged", runtime.model_dir("logged", PRINTING))
        runtime.infer_fp32("logged", [1.0])
        runtime.unload("logged")
        time.sleep(0.2)
        entries = [json.loads(line) for line in runtime.log().splitlines() if line.strip()]
    printed = {e["message"]: e.get("model_id") for e in entries if e["logger"] in ("stdout", "stderr")}
    assert printed == {"printed at load": "logged", "written to stderr": "logged"}
    assert any("warned at load" in e["message"] and e.get("model_id") == "logged" for e in entries)
    loaded = [e for e in entries if e.get("model_id") == "logged" and e["message"].startswith("loaded")]
    assert loaded and {"time", "level", "role", "pid"} <= set(loaded[0])
    assert any(e["message"].startswith("logged unloaded") for e in entries)
    assert {e["role"] for e in entries} >= {"front", "worker"}
