"""The servers bench/scale.py fills with models: mesh-runtime, and MLServer beside it.

Each runs in its own memory cgroup (meshtest/cgroup.py) and is driven the same
way: `load(i)` (returns the size the server reported, 0 when it reports
none), `infer(i)`, `unload(i)`, and the waits that let a measurement start
only once the server has finished what a call set off (forking a spare,
reaping a worker).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from typing import Protocol

import grpc
import psutil

from bench.installers import ensure_mlserver
from bench.servers import stop_process, wait_port
from meshtest import cgroup, harness
from protos import grpc_predict_v2_pb2 as pb
from protos import grpc_predict_v2_pb2_grpc as pb_grpc
from protos import model_runtime_pb2 as mm
from runtime.admin import cli as admin

WARM = 2  # the product's WORKERS_WARM
SAMPLE = [[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]]


def model_id(index: int) -> str:
    return f"m{index:04d}"


def iris_request(index: int) -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model_id(index))
    features = request.inputs.add(name="features", datatype="FP32", shape=[2, 4])
    features.contents.fp32_contents.extend(value for row in SAMPLE for value in row)
    return request


class ScaleServer(Protocol):
    name: str

    def load(self, index: int) -> int: ...
    def infer(self, index: int) -> None: ...
    def unload(self, index: int) -> None: ...
    def wait_settled(self) -> None: ...
    def wait_unloaded(self) -> None: ...
    def root_pid(self) -> int: ...
    def held_back(self) -> int: ...
    def front_fds(self) -> int: ...


class MeshRuntime:
    """mesh-runtime with the product's defaults, every installed framework preloaded."""

    name = "mesh-runtime"

    def __init__(self, models: list[str], fmt: str, meter: cgroup.Meter, models_per_worker: int = 1):
        self.models, self.fmt, self.meter = models, fmt, meter
        self.packed = models_per_worker > 1  # small models share packs: no worker of their own
        self.loaded = 0
        self.rt = harness.Runtime(
            command_prefix=meter.command_prefix(),
            preload_frameworks=True,
            ROOT_MODEL_DIR=os.path.dirname(models[0]),
            WORKERS_WARM=str(WARM),
            MODELS_PER_WORKER=str(models_per_worker),
            LOG_LEVEL="warning",  # a log file's pages would be charged to the cgroup too
        )

    def __enter__(self) -> MeshRuntime:
        self.rt.start()
        self.meter.root_pid = self.rt.pid
        return self

    def __exit__(self, *exc) -> None:
        self.rt.stop()

    def load(self, index: int) -> int:
        size = self.rt.load(model_id(index), self.models[index], fmt=self.fmt, timeout=120).sizeInBytes
        self.loaded += 1
        return size

    def infer(self, index: int) -> None:
        self.infer_within(index, 30)

    def unload(self, index: int) -> None:
        self.rt.unload(model_id(index))
        self.loaded -= 1

    def try_infer(self, index: int, deadline_s: float) -> grpc.StatusCode:
        """One call to model `index`; its status, OK or not, instead of an exception."""
        try:
            self.infer_within(index, deadline_s)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    def infer_within(self, index: int, deadline_s: float) -> None:
        self.rt.infer.ModelInfer(
            iris_request(index), metadata=harness.mesh_headers(model_id(index)), timeout=deadline_s
        )

    def worker_pids(self) -> dict[int, int]:
        """The pid serving each loaded model, by index, read from the workers' titles; with packs,
        whose titles name no model, asked of the front's admin socket as inspect-workers does."""
        if self.packed:
            return self._pids_from_admin()
        pids = {}
        for process in self.rt.workers():
            try:
                title = " ".join(process.cmdline())
            except psutil.Error:
                continue
            for word in title.split():
                if word.startswith("model=m") and word[len("model=m") :].isdigit():
                    pids[int(word[len("model=m") :])] = process.pid
        return pids

    def _pids_from_admin(self) -> dict[int, int]:
        pids = {}
        rows = admin.ask(self.rt.env["RUNTIME_DIR"], "workers")
        assert isinstance(rows, list), rows
        for row in rows:
            held = [m["model"] for m in row["models"]] if row["role"] == "pack" else [row["model"]]
            pids.update({int(m[1:]): row["pid"] for m in held if m.startswith("m") and m[1:].isdigit()})
        return pids

    def held_back(self) -> int:
        """What capacityInBytes holds back for packs not yet full (0 without packs): model-mesh
        fills the pod up to capacity, so this counts with the sizes against what the pod grew by."""
        pool = admin.ask(self.rt.env["RUNTIME_DIR"], "pool")
        assert isinstance(pool, dict), pool
        return pool["held_for_open_packs_bytes"]

    def reported_now(self) -> int:
        """The sum of what modelSize says of every loaded model now."""
        return sum(
            self.rt.mesh.modelSize(mm.ModelSizeRequest(modelId=model_id(i)), timeout=30).sizeInBytes
            for i in range(self.loaded)
        )

    def _workers_are(self, models: int) -> bool:
        """`models` model workers plus the spares of every fork server in use, and no other worker."""
        spares = self.rt.spares_wanted(WARM)
        own = 0 if self.packed else models  # packs are titled apart (harness.Runtime.packs)
        return (
            len(harness.alive(self.rt.spares())) == spares
            and len(harness.alive(self.rt.workers())) == own + spares
            and (models > 0 or not harness.alive(self.rt.packs()))
        )

    def wait_settled(self) -> None:
        harness.wait_until(
            lambda: self._workers_are(self.loaded), timeout=120, interval=0.2, what="the pool to settle"
        )

    def wait_unloaded(self) -> None:
        harness.wait_until(
            lambda: self._workers_are(0), timeout=120, interval=0.1, what="every worker reaped"
        )

    def root_pid(self) -> int:
        return self.rt.pid

    def front_fds(self) -> int:
        return psutil.Process(self.rt.pid).num_fds()


class MLServerRepository:
    """MLServer 1.7.1 (one process, mlserver-sklearn) loading models through its repository API."""

    name = "MLServer"

    def __init__(self, models: list[str], fmt: str, meter: cgroup.Meter):
        assert fmt == "sklearn", "MLServer is measured with sklearn models"
        self.executable = ensure_mlserver()
        self.meter = meter
        self.models = models
        self.folder = os.path.dirname(models[0])
        self.grpc_port, self.http_port = harness.free_port(), harness.free_port()
        server_settings = {
            "host": "127.0.0.1",
            "grpc_port": self.grpc_port,
            "http_port": self.http_port,
            "metrics_port": harness.free_port(),
            "parallel_workers": 0,
            "load_models_at_startup": False,
        }
        self._write(os.path.join(self.folder, "settings.json"), server_settings)
        self.log_path = os.path.join(os.path.dirname(self.folder), "mlserver-scale.log")

    @staticmethod
    def _write(path: str, content: dict) -> None:
        with open(path, "w") as f:
            json.dump(content, f)

    def __enter__(self) -> MLServerRepository:
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [*self.meter.command_prefix(), self.executable, "start", self.folder],
            cwd=self.folder,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.meter.root_pid = self.process.pid
        wait_port(self.grpc_port, self.process, self.log_path, 180)
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.grpc_port}")
        self.stub = pb_grpc.GRPCInferenceServiceStub(self.channel)
        return self

    def __exit__(self, *exc) -> None:
        self.channel.close()
        stop_process(self.process)
        self.log.close()

    def _repository(self, index: int, verb: str) -> None:
        url = f"http://127.0.0.1:{self.http_port}/v2/repository/models/{model_id(index)}/{verb}"
        with urllib.request.urlopen(urllib.request.Request(url, method="POST", data=b""), timeout=120):
            pass

    def load(self, index: int) -> int:
        # A model's settings appear in the repository as it is loaded, as model-mesh's
        # puller lays each model out just before its load: MLServer searches the
        # whole repository for the model at every load.
        settings = {
            "name": model_id(index),
            "implementation": "mlserver_sklearn.SKLearnModel",
            "parameters": {"uri": "./model.joblib"},
        }
        self._write(os.path.join(self.models[index], "model-settings.json"), settings)
        self._repository(index, "load")
        return 0  # MLServer reports no sizes

    def infer(self, index: int) -> None:
        self.stub.ModelInfer(iris_request(index), timeout=30)

    def unload(self, index: int) -> None:
        self._repository(index, "unload")

    def held_back(self) -> int:
        return 0  # it reports no sizes and holds nothing back

    def wait_settled(self) -> None:
        time.sleep(0.5)  # one process: nothing starts or ends in the background

    def wait_unloaded(self) -> None:
        pass

    def root_pid(self) -> int:
        return self.process.pid

    def front_fds(self) -> int:
        return psutil.Process(self.process.pid).num_fds()
