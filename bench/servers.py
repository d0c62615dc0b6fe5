"""The servers the data plane measures, each started in its own process and stopped with its tree.

Canned is bench/canned_server.py (cases a, a' and a2: a bare grpc.aio server answering fixed
bytes); MLServer is MLServer 1.7.1 from .bench/mlserver-venv (case d); mesh-runtime itself
(cases b and c) is meshtest.harness.Runtime with the product's WORKERS_WARM, serving the echo
model and iris (load_iris_model).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import grpc
import psutil

from bench.common import REPO, progress
from bench.installers import ensure_mlserver
from meshtest import harness
from protos import grpc_predict_v2_pb2 as pb
from protos import grpc_predict_v2_pb2_grpc as pb_grpc

RUNTIME_ENV = {"WORKERS_WARM": "2"}  # the product default (the test harness lowers it to 1)


def wait_port(port: int, process: subprocess.Popen, log_path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    # grpc's default reconnect backoff (1 s) would hold each start for most of a second.
    quick_retries = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.max_reconnect_backoff_ms", 200)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=quick_retries) as channel:
        while True:
            try:
                grpc.channel_ready_future(channel).result(timeout=0.5)
                return
            except grpc.FutureTimeoutError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                with open(log_path, errors="replace") as f:
                    tail = f.read()[-3000:]
                raise RuntimeError(f"server on port {port} did not start (exit {process.poll()}):\n{tail}")


def stop_process(process: subprocess.Popen) -> None:
    """SIGTERM the process group we started (its own session), SIGKILL after 10 s."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass


def canned_command(port: int, response_path: str, *options: str) -> list[str]:
    """The command line of bench/canned_server.py; run it with cwd=REPO, where `bench` is found."""
    return [
        sys.executable,
        "-m",
        "bench.canned_server",
        "--port",
        str(port),
        "--response",
        response_path,
        *options,
    ]


class Canned:
    """bench/canned_server.py in a subprocess, answering with `response`."""

    def __init__(self, folder: str, name: str, response: bytes, hop: bool = False, uvloop: bool = False):
        self.folder = folder
        self.hop = hop
        self.uvloop = uvloop
        self.port = harness.free_port()
        self.response_path = os.path.join(folder, f"canned-{name}.bin")
        with open(self.response_path, "wb") as f:
            f.write(response)
        self.log_path = os.path.join(folder, f"canned-{name}.log")

    def __enter__(self) -> Canned:
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            canned_command(
                self.port,
                self.response_path,
                *(["--hop"] if self.hop else []),
                *(["--uvloop"] if self.uvloop else []),
            ),
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_port(self.port, self.process, self.log_path, 30)
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.process)
        self.log.close()

    def processes(self) -> list[psutil.Process]:
        return harness.tree(self.process.pid)  # with --hop, its child too


ECHO_MLSERVER = '''
from mlserver import MLModel
from mlserver.types import InferenceRequest, InferenceResponse, ResponseOutput


class EchoModel(MLModel):
    """Returns its inputs as outputs (the 1 MiB case of mesh-runtime's data-plane benchmark)."""

    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        return InferenceResponse(model_name=self.name, outputs=[
            ResponseOutput(name=i.name, shape=i.shape, datatype=i.datatype, data=i.data)
            for i in payload.inputs])
'''


class MLServer:
    """MLServer 1.7.1 from .bench/mlserver-venv serving iris (mlserver-sklearn) and an echo model."""

    def __init__(self, folder: str, joblib_path: str):
        self.executable = ensure_mlserver()
        self.folder = os.path.join(folder, "mlserver")
        self.port = harness.free_port()
        for name in ("iris", "echo"):
            os.makedirs(os.path.join(self.folder, name))
        shutil.copy(joblib_path, os.path.join(self.folder, "iris", "model.joblib"))
        with open(os.path.join(self.folder, "echo", "echo_model.py"), "w") as f:
            f.write(ECHO_MLSERVER)
        self.settings = {
            "host": "127.0.0.1",
            "grpc_port": self.port,
            "http_port": harness.free_port(),
            "metrics_port": harness.free_port(),
            "parallel_workers": 0,
        }
        self._write("settings.json", self.settings)
        self._write(
            "iris/model-settings.json",
            {
                "name": "iris",
                "implementation": "mlserver_sklearn.SKLearnModel",
                "parameters": {"uri": "./model.joblib"},
            },
        )
        self._write("echo/model-settings.json", {"name": "echo", "implementation": "echo_model.EchoModel"})
        self.log_path = os.path.join(folder, "mlserver.log")

    def _write(self, name: str, content: dict) -> None:
        with open(os.path.join(self.folder, name), "w") as f:
            json.dump(content, f, indent=2)

    def __enter__(self) -> MLServer:
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [self.executable, "start", self.folder],
            cwd=self.folder,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_port(self.port, self.process, self.log_path, 180)
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            deadline = time.monotonic() + 120
            for name in ("iris", "echo"):
                while True:
                    try:
                        if stub.ModelReady(pb.ModelReadyRequest(name=name), timeout=5).ready:
                            break
                    except grpc.RpcError:
                        pass
                    if time.monotonic() > deadline or self.process.poll() is not None:
                        raise RuntimeError(f"MLServer never made {name} ready; log {self.log_path}")
                    time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.process)
        self.log.close()

    def processes(self) -> list[psutil.Process]:
        root = psutil.Process(self.process.pid)
        return [root, *root.children(recursive=True)]


# -- models ---------------------------------------------------------------------------------


def train_iris(path: str) -> None:
    import joblib
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    features, labels = load_iris(return_X_y=True)
    joblib.dump(LogisticRegression(max_iter=1000).fit(features, labels), path)


IRIS_CUSTOM = """
    import glob, os
    import joblib

    class Model:
        def __init__(self, path):
            self.clf = joblib.load(glob.glob(os.path.join(path, "*.joblib"))[0])

        def predict(self, inputs):
            return {"predict": self.clf.predict(next(iter(inputs.values())))}
"""


def load_iris_model(rt: harness.Runtime) -> str:
    """Loads iris with the sklearn format; a custom python model doing the same when it is not usable."""
    folder = os.path.join(rt.models, "iris")
    os.makedirs(folder)
    train_iris(os.path.join(folder, "model.joblib"))
    try:
        rt.load("iris", folder, fmt="sklearn")
        return "sklearn format"
    except grpc.RpcError as error:
        reason = f"{error.code().name}: {error.details()}"
    progress(f"the sklearn format is not usable ({reason}); serving iris with a custom python model")
    custom = os.path.join(rt.models, "iris-custom")
    shutil.copytree(folder, custom)
    harness.write_model(custom, IRIS_CUSTOM)
    rt.load("iris", custom, fmt="python")
    return f"custom python model (sklearn format not usable: {reason[:80]})"


def stop_runtime(rt: harness.Runtime) -> None:
    if rt.process is None:
        return
    try:
        rt.stop()
    except Exception as error:
        print(f"warning: stopping the runtime: {error!r} (log: {rt.log_path})", file=sys.stderr)
