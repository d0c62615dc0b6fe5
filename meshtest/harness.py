"""Runs a real mesh-runtime in a subprocess and talks to it the way model-mesh does.

Every test that needs a runtime goes through `Runtime`: it picks a free port,
makes private ROOT_MODEL_DIR / PVC_MOUNTS_DIR / RUNTIME_DIR folders, starts
`python -m runtime`, polls runtimeStatus until READY (as mesh does), and on
stop checks that the whole process tree is gone.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Iterable

import grpc
import numpy as np
import psutil

from protos import grpc_predict_v2_pb2 as v2
from protos import grpc_predict_v2_pb2_grpc as v2_grpc
from protos import model_runtime_pb2 as mm
from protos import model_runtime_pb2_grpc as mm_grpc

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1024 * 1024


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape_metrics(runtime: Runtime) -> str:
    """The runtime's Prometheus page (it must have been started with METRICS_PORT set to a free port)."""
    port = runtime.env["METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        return answer.read().decode()


def metric_sample(text: str, name: str, **labels) -> float:
    """The value of the sample `name` with exactly these labels in a scraped page."""
    want = sorted(f'{key}="{value}"' for key, value in labels.items())
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels else " ")):
            metric, value = line.rsplit(" ", 1)
            if not labels or sorted(metric[len(name) :].strip("{}").split(",")) == want:
                return float(value)
    raise AssertionError(f"no sample {name}{{{','.join(want)}}}")


def uss(pid: int) -> int:
    """USS of one process, measured from outside with psutil."""
    return psutil.Process(pid).memory_full_info().uss


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def tree_uss(pid: int) -> int:
    total = 0
    for process in tree(pid):
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                total += process.memory_full_info().uss
        except psutil.NoSuchProcess:
            pass
    return total


def alive(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    """Those still running (zombies count as gone: they hold no memory)."""
    result = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                result.append(process)
        except psutil.NoSuchProcess:
            pass
    return result


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.02, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def expect_status(code: grpc.StatusCode, call, *args, **kwargs) -> grpc.RpcError:
    """Calls call(*args, **kwargs), which must fail with gRPC status `code`; returns the error,
    so that the test can check its details().

    Fails the test if the call succeeds or fails with another code, showing what came back.
    """
    __tracebackhide__ = True  # pytest then points at the test's line, not at this one
    try:
        answer = call(*args, **kwargs)
    except grpc.RpcError as error:
        if error.code() != code:
            got = f"got {error.code().name}: {error.details()!r}"
            raise AssertionError(f"expected {code.name}, {got}") from None
        return error
    shown = repr(answer)
    shown = shown if len(shown) <= 300 else shown[:300] + "..."
    raise AssertionError(f"expected {code.name}, but the call succeeded and returned {shown}")


def status_of(call, *args, **kwargs) -> grpc.StatusCode:
    """The status call(*args, **kwargs) ends with: OK, or its error's code.

    For a test that accepts several outcomes, or collects them from threads;
    one that expects a single error uses expect_status.
    """
    try:
        call(*args, **kwargs)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def write_model(folder: str, source: str) -> str:
    """Writes a custom model (model.py) into folder; returns the folder."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "model.py"), "w") as f:
        f.write(textwrap.dedent(source))
    return folder


ECHO_MODEL = """
    import numpy as np

    class Model:
        def __init__(self, path):
            self.path = path

        def predict(self, inputs):
            return {name: value for name, value in inputs.items()}
"""


# Allocates ALLOC_MIB (written so the pages are really used), then sleeps
# SLEEP_S seconds if the file "slow" is in its folder.
def allocating_model(alloc_mib: int, sleep_s: float = 0.0) -> str:
    return f"""
    import os, time
    import numpy as np

    class Model:
        def __init__(self, path):
            self.ballast = np.ones({alloc_mib} * 1024 * 1024, dtype=np.uint8)
            if os.path.exists(os.path.join(path, "slow")):
                time.sleep({sleep_s})

        def predict(self, inputs):
            return {{"size": np.array([self.ballast.size], dtype=np.int64)}}
    """


class Runtime:
    def __init__(self, command_prefix: tuple[str, ...] = (), preload_frameworks: bool = False, **env: str):
        """env: settings for the runtime; command_prefix: runs it under a tool (valgrind, say).

        The fork server preloads only numpy unless `preload_frameworks` (or
        WORKER_PRELOAD is given): importing every framework costs each start
        seconds that only tests of the formats, and benchmarks, need to pay.
        """
        self.command_prefix = command_prefix
        self.root = tempfile.mkdtemp(prefix="mr-")
        self.models = os.path.join(self.root, "models")
        self.pvc = os.path.join(self.root, "pvc")
        # The runtime's temp files (multiprocessing's folder among them) go where stop() removes them,
        # even those of a front a test SIGKILLs.
        temp = os.path.join(self.root, "tmp")
        for folder in (self.models, self.pvc, temp):
            os.makedirs(folder)
        self.port = free_port()
        self.env = {
            **os.environ,
            "RUNTIME_PORT": str(self.port),
            "RUNTIME_DIR": os.path.join(self.root, "run"),
            "ROOT_MODEL_DIR": self.models,
            "PVC_MOUNTS_DIR": self.pvc,
            "TMPDIR": temp,
            "WORKERS_WARM": "1",
            "METRICS_PORT": "0",
            "LOG_LEVEL": "info",
            # A worker per model, whose title names it (worker_for): tests of packs ask for them.
            "MODELS_PER_WORKER": "1",
            **({} if preload_frameworks else {"WORKER_PRELOAD": "numpy"}),
            **env,
        }
        self.process: subprocess.Popen | None = None
        self.log_path = os.path.join(self.root, "runtime.log")
        self.channel: grpc.Channel | None = None

    # -- life ---------------------------------------------------------------------

    def start(self, wait_ready: bool = True) -> Runtime:
        self._log = open(self.log_path, "ab")
        self.process = subprocess.Popen(
            [*self.command_prefix, sys.executable, "-m", "runtime"],
            cwd=REPO,
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.channel = grpc.insecure_channel(
            f"127.0.0.1:{self.port}",
            options=[
                ("grpc.max_send_message_length", 64 * MiB),
                ("grpc.max_receive_message_length", 64 * MiB),
                # The first attempt comes before the front listens; grpc's default backoff (1 s)
                # would then hold every test's start for most of a second.
                ("grpc.initial_reconnect_backoff_ms", 50),
                ("grpc.max_reconnect_backoff_ms", 200),
            ],
        )
        self.mesh = mm_grpc.ModelRuntimeStub(self.channel)
        self.infer = v2_grpc.GRPCInferenceServiceStub(self.channel)
        if wait_ready:
            self.status = self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60.0) -> mm.RuntimeStatusResponse:
        """Polls runtimeStatus like model-mesh until READY."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"runtime exited with {self.process.returncode}:\n{self.log()}")
            try:
                answer = self.mesh.runtimeStatus(mm.RuntimeStatusRequest(), timeout=10)
                if answer.status == mm.RuntimeStatusResponse.READY:
                    return answer
            except grpc.RpcError as error:
                if error.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
            time.sleep(0.05)
        raise AssertionError(f"runtime not READY after {timeout} s:\n{self.log()}")

    def stop(self) -> None:
        """SIGTERM, wait, and check that no process of the tree is left."""
        if self.process is None:
            return
        processes = tree(self.process.pid) if self.process.poll() is None else []
        self.terminate()
        self.channel.close()
        self._log.close()
        if alive(processes):
            wait_until(lambda: not alive(processes), timeout=10, what="the runtime's processes to end")
        shutil.rmtree(self.root, ignore_errors=True)

    def terminate(self) -> None:
        """SIGTERM and wait for the front to exit; SIGKILL after 30 s."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    # -- processes ------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.process.pid

    def workers(self) -> list[psutil.Process]:
        return [p for p in tree(self.pid) if "mesh-runtime worker" in " ".join(_cmdline(p))]

    def worker_for(self, model_id: str) -> psutil.Process | None:
        for process in self.workers():
            if f"model={model_id}" in " ".join(_cmdline(process)):
                return process
        return None

    def packs(self) -> list[psutil.Process]:
        """Workers that hold several models (MODELS_PER_WORKER > 1), titled `pack models=N`."""
        return [p for p in tree(self.pid) if "mesh-runtime pack" in " ".join(_cmdline(p))]

    def spares(self) -> list[psutil.Process]:
        return [p for p in self.workers() if "worker spare" in " ".join(_cmdline(p))]

    def forkservers(self) -> list[psutil.Process]:
        """The fork servers running: the base one, and one per framework a model was loaded of. The
        front's children alone: a worker just forked carries its fork server's title for a moment."""
        try:
            children = psutil.Process(self.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [p for p in children if "mesh-runtime forkserver" in " ".join(_cmdline(p))]

    def spares_wanted(self, warm: int) -> int:
        """The spares a settled runtime keeps: `warm` (its WORKERS_WARM) per fork server."""
        return warm * max(1, len(alive(self.forkservers())))

    def settled_uss(self, warm: int = 1, timeout: float = 15.0) -> int:
        """Tree USS once exactly `warm` spares per fork server run and two readings 0.3 s apart
        agree (same processes, within 0.5 MiB): no worker still starting or dying."""
        deadline = time.monotonic() + timeout
        previous = None
        while time.monotonic() < deadline:
            if len(alive(self.spares())) == self.spares_wanted(warm):
                reading = (sorted(p.pid for p in alive(tree(self.pid))), tree_uss(self.pid))
                if previous and previous[0] == reading[0] and abs(previous[1] - reading[1]) < MiB // 2:
                    return reading[1]
                previous = reading
            time.sleep(0.3)
        raise AssertionError(f"the runtime's memory did not settle within {timeout} s")

    def model_workers(self) -> int:
        return len([p for p in self.workers() if "model=" in " ".join(_cmdline(p))])

    # -- model-mesh's calls -----------------------------------------------------------

    def model_dir(self, name: str, source: str = ECHO_MODEL) -> str:
        return write_model(os.path.join(self.models, name), source)

    def load(
        self,
        model_id: str,
        path: str,
        model_type: str = "",
        fmt: str | None = "python",
        timeout: float | None = 60,
    ) -> mm.LoadModelResponse:
        key = json.dumps({"model_type": {"name": fmt}, "disk_size_bytes": 0}) if fmt else ""
        return self.mesh.loadModel(
            mm.LoadModelRequest(modelId=model_id, modelType=model_type, modelPath=path, modelKey=key),
            timeout=timeout,
        )

    def load_future(self, model_id: str, path: str, fmt: str = "python"):
        key = json.dumps({"model_type": {"name": fmt}})
        return self.mesh.loadModel.future(mm.LoadModelRequest(modelId=model_id, modelPath=path, modelKey=key))

    def unload(self, model_id: str) -> None:
        self.mesh.unloadModel(mm.UnloadModelRequest(modelId=model_id), timeout=60)

    def infer_fp32(
        self, model_id: str, values, name: str = "x", headers: bool = True, request_name: str | None = None
    ) -> v2.ModelInferResponse:
        array = np.asarray(values, dtype=np.float32)
        request = v2.ModelInferRequest(model_name=model_id if request_name is None else request_name)
        request.inputs.add(name=name, datatype="FP32", shape=array.shape).contents.fp32_contents.extend(
            array.ravel()
        )
        metadata = mesh_headers(model_id) if headers else None
        return self.infer.ModelInfer(request, metadata=metadata, timeout=30)


def mesh_headers(model_id: str) -> list[tuple[str, object]]:
    """The headers model-mesh adds to a forwarded call (contract doc section 4.2)."""
    headers: list[tuple[str, object]] = [("mm-model-id-bin", model_id.encode())]
    if all(32 <= ord(c) <= 126 for c in model_id):
        headers.append(("mm-model-id", model_id))
    return headers


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []
