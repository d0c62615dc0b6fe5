"""The fork server warms each imported format (workers/formats/warming.py): workers still predict right,
the fork server gains no thread, and a warm-up that fails is reported without stopping it.
"""

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import psutil
import pytest
from harness import REPO, Runtime, tree
from test_formats import (
    EXAMPLES,
    FORMAT_NAMES,
    assert_same,
    direct,
    example_path,
    infer,
    make_examples,
    outputs_of,
)

from runtime import forkserver
from runtime.variables import default_preload
from workers.formats import warming

# The shared runtime preloads, and so warms, every installed framework.
PRELOAD_FRAMEWORKS = True
pytestmark = pytest.mark.slow

# A fork server's sequence in a fresh interpreter: the thread pools sized, the
# frameworks named in argv[1] ("all": every installed one) and the format
# modules imported, then the warm-ups.
FORKSERVER_SEQUENCE = """
    import importlib, importlib.util, json, os, sys
    from workers import formats
    from workers.formats import warming

    def threads():
        return len(os.listdir("/proc/self/task"))

    warming.limit_thread_pools()
    import numpy
    for fmt in formats.FORMATS:
        wanted = sys.argv[1] == "all" or fmt.framework in sys.argv[1].split(",")
        if fmt.framework and wanted and importlib.util.find_spec(fmt.framework):
            importlib.import_module(fmt.framework)
        importlib.import_module(fmt.module)
    before = threads()
    warming.warm_imported()
    print(json.dumps({"before": before, "after": threads()}))
"""


def forkserver_pids(runtime: Runtime) -> dict[str, int]:
    """The pid of each fork server running, by the group its title names ("base" or a framework)."""
    pids = {}
    for process in tree(runtime.pid):
        words = " ".join(process.cmdline()).split()
        if "forkserver" in words:
            pids[words[words.index("forkserver") + 1]] = process.pid
    return pids


@pytest.fixture(scope="module")
def examples(runtime):
    pytest.importorskip("sklearn", reason="the examples need scikit-learn's iris data")
    written = make_examples.make(runtime.models, log=lambda line: None)
    return {example.format: os.path.join(runtime.models, example.name) for example in written}


def thread_counts(worker_threads: str, frameworks: str = "all") -> dict:
    """Threads of a fresh interpreter after the fork server's imports ("before") and after its warm-ups."""
    env = {name: value for name, value in os.environ.items() if name not in warming.THREAD_POOL_VARIABLES}
    sequence = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FORKSERVER_SEQUENCE), frameworks],
        cwd=REPO,
        env={**env, "WORKER_THREADS": worker_threads},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "mesh-runtime forkserver" not in sequence.stderr, sequence.stderr  # no warm-up failed
    return json.loads(sequence.stdout)


def thread_counts_of(wanted: list[tuple[str, str]]) -> list[dict]:
    """thread_counts(worker_threads, frameworks) of each pair, two interpreters at a time: each
    spends seconds importing, on one core; the counts are each interpreter's own."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda pair: thread_counts(*pair), wanted))


@pytest.fixture(scope="module")
def all_frameworks_thread_counts() -> dict[str, dict]:
    """thread_counts(worker_threads) with every framework, by WORKER_THREADS."""
    return dict(zip(["1", "2"], thread_counts_of([("1", "all"), ("2", "all")]), strict=True))


# With more than one thread per call, OpenMP may start its pool, so warm-ups that run OpenMP loops skip them.
@pytest.mark.parametrize("worker_threads", ["1", "2"])
def test_warming_starts_no_thread(all_frameworks_thread_counts, worker_threads):
    counts = all_frameworks_thread_counts[worker_threads]
    assert counts["after"] == counts["before"], counts


def test_each_fork_server_imports_one_framework_and_runs_only_the_threads_its_imports_started(
    runtime, examples
):
    """onnxruntime's import starts one; each fork server, which warmed without a complaint, has no other."""
    for fmt in FORMAT_NAMES:  # each format's first load starts its framework's fork server
        runtime.load(f"threads-{fmt}", example_path(examples, fmt), fmt=fmt)
        runtime.unload(f"threads-{fmt}")
    assert "mesh-runtime forkserver" not in runtime.log()
    pids = forkserver_pids(runtime)
    preload = default_preload()
    assert set(pids) == {forkserver.group_for(fmt, preload) for fmt in FORMAT_NAMES}
    threads = {group: len(os.listdir(f"/proc/{pid}/task")) for group, pid in pids.items()}
    imported = ["" if group == forkserver.BASE_GROUP else group.replace("+", ",") for group in threads]
    fresh = thread_counts_of([("1", frameworks) for frameworks in imported])
    for (group, count), expected in zip(threads.items(), fresh, strict=True):
        assert count == expected["before"], group


@pytest.mark.parametrize("fmt", FORMAT_NAMES)
def test_a_worker_of_each_format_predicts_after_warming(rt, examples, fmt):
    path = example_path(examples, fmt)
    model_id = f"warmed-{fmt}"
    rt.load(model_id, path, fmt=fmt)
    try:
        served = outputs_of(infer(rt, model_id, make_examples.SAMPLE, outputs=EXAMPLES[fmt].outputs))
        assert_same(served, direct(fmt, path, make_examples.SAMPLE))
        first = next(iter(served.values()))  # labels, or one probability per class
        assert list(first.argmax(axis=1) if first.ndim == 2 else first) == [0, 2]
    finally:
        rt.unload(model_id)


# Makes sklearn.tree look broken, so that warming sklearn fails on importing it.
BREAKING_SITECUSTOMIZE = """
    import sys
    sys.modules["sklearn.tree"] = None
"""


def test_a_failing_warm_up_is_reported_and_the_forkserver_serves_on(tmp_path):
    pytest.importorskip("sklearn", reason="pip install 'mesh-runtime[sklearn]'")
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(BREAKING_SITECUSTOMIZE))
    with Runtime(PYTHONPATH=str(tmp_path), WORKER_PRELOAD="numpy,sklearn") as runtime:
        folder = os.path.join(runtime.models, "iris-sklearn")
        os.makedirs(folder)
        make_examples.write_sklearn(folder, make_examples.iris())  # needs no sklearn.tree to load
        runtime.load("iris", folder, fmt="sklearn")  # starts the sklearn fork server
        assert "cannot warm sklearn: ModuleNotFoundError" in runtime.log()
        assert psutil.Process(forkserver_pids(runtime)["sklearn"]).is_running()
        labels = outputs_of(infer(runtime, "iris", make_examples.SAMPLE))["predict"]
        assert list(labels) == [0, 2]


def test_a_preloaded_module_that_starts_a_thread_is_reported_and_the_frameworks_are_not():
    with Runtime(WORKER_PRELOAD="numpy,meshtest.starts_a_thread", WORKER_THREADS="2") as runtime:
        log = runtime.log()
    assert "importing meshtest.starts_a_thread started a thread, which no worker forked" in log
    assert log.count("started a thread") == 1, log  # numpy's BLAS pool (2 threads per call) is not


# The fork server's step after the warm-ups, in a fresh interpreter; argv[1] "hang" replaces the
# formats' touches with one that never returns, and a short deadline.
TOUCH_SEQUENCE = """
    import importlib, json, os, sys, time
    from workers import formats
    from workers.formats import warming

    warming.limit_thread_pools()
    import numpy
    if sys.argv[1] == "hang":
        warming._touches_of_imported_formats = lambda: [("stuck", lambda: time.sleep(600))]
        warming.TOUCH_CHILD_SECONDS = 0.5
    else:
        importlib.import_module("torch")
    for fmt in formats.FORMATS:
        importlib.import_module(fmt.module)
    warming.warm_imported()
    before = len(os.listdir("/proc/self/task"))
    ran = warming.touch_compute_code_in_a_child()
    after = len(os.listdir("/proc/self/task"))
    try:
        os.waitpid(-1, os.WNOHANG)
        children = True
    except ChildProcessError:
        children = False
    print(json.dumps({"ran": ran, "before": before, "after": after, "children": children}))
"""


def touch_sequence(mode: str) -> tuple[dict, str]:
    sequence = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TOUCH_SEQUENCE), mode],
        cwd=REPO,
        env={**os.environ, "WORKER_THREADS": "2"},  # torch's ops would start a pool in this process
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(sequence.stdout), sequence.stderr


def test_the_first_tensor_ops_run_in_a_child_that_is_reaped():
    pytest.importorskip("torch", reason="pip install 'mesh-runtime[pytorch]'")
    result, stderr = touch_sequence("torch")
    assert result["ran"], stderr
    assert result["after"] <= result["before"], result  # the fork server started no thread
    assert not result["children"], result


def test_a_child_whose_tensor_ops_hang_is_killed_reaped_and_reported():
    result, stderr = touch_sequence("hang")
    assert not result["ran"] and not result["children"], result
    assert "the child running the first tensor ops took over 0.5 s; killed" in stderr


def test_onnx_touches_its_kernels_with_a_graph_written_without_the_onnx_package():
    onnxruntime = pytest.importorskip("onnxruntime", reason="pip install 'mesh-runtime[onnx]'")
    from workers.formats import onnx as onnx_format

    graph = onnx_format._small_graph()
    session = onnxruntime.InferenceSession(graph, providers=["CPUExecutionProvider"])
    probabilities, label = session.run(None, {"features": np.array([[1, 2, 3, 4]], dtype=np.float32)})
    assert probabilities.shape == (1, 3) and abs(float(probabilities.sum()) - 1) < 1e-6
    assert label.dtype == np.int64 and label.shape == (1,)
    onnx_format.touch_compute_code()
    onnx = pytest.importorskip("onnx", reason="the examples' extra brings the onnx package")
    onnx.checker.check_model(onnx.load_from_string(graph))
