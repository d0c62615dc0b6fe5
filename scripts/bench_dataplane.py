#!/usr/bin/env python3
"""Data-plane benchmark: ModelInfer throughput and latency under h2load, against the issue's targets.

A real HTTP/2 load generator, h2load (Debian package nghttp2-client, installed
with apt-get when missing and we are root), drives gRPC unary calls: it POSTs
a length-prefixed protobuf body (1 byte 0, 4-byte big-endian length, the
serialised ModelInferRequest) with `content-type: application/grpc`,
`te: trailers` and model-mesh's `mm-model-id` / `mm-model-id-bin` headers,
one stream at a time per connection (-m 1) over 1 or 16 connections.

Cases (each at concurrency 1 and 16):
  (a) scripts/canned_server.py: a bare grpc.aio server answering every call
      with fixed response bytes (the ceiling of a Python front),
  (a') the same on uvloop, the event loop mesh-runtime's front runs on by
      default (a reference, not a target: what the loop alone changes),
  (a2) the same on uvloop with --hop: every call's bytes go over ZeroMQ to a
      child process that answers the fixed bytes (the ceiling of a front that
      forwards; not a target, it shows what the hop alone costs),
  (b) mesh-runtime serving an echo model (FP32 [1,4] in, the same out),
  (c) mesh-runtime serving a scikit-learn LogisticRegression trained on iris
      (sklearn format; FP32 [1,4] in, `predict` out; should that format not
      load, a custom python model doing the same, and the output says so),
  (d) with --peer mlserver: MLServer 1.7.1 + mlserver-sklearn serving the same
      joblib file (parallel_workers 0), installed into .bench/mlserver-venv,
and a 1 MiB request (FP32 [1, 262144] in raw_input_contents) for (a), (b)
and (d) (an echo MLServer model: a 10-line MLModel returning its inputs).

h2load counts HTTP 200 only, and gRPC answers errors with HTTP 200 too, so
every point is checked three ways: before it, 20 calls through a Python grpc
channel with the same bytes and headers must return status OK and the
expected outputs, and nghttp must see `grpc-status: 0` for the exact body
file h2load sends; during it, the DATA bytes h2load received must equal
(requests x framed response size), which no error response (it has no
message) can fake; after it, 5 more Python calls must succeed. A point that
fails a check is an ERROR row, never a number.

Each point is a 1 s h2load warm-up run, then the measured run (8 s by
default). req/s is h2load's; p50/p99 are nearest-rank percentiles of its
per-request log (--log-file; h2load itself prints only mean/sd/max). The
`other cpu` column is the CPU the rest of the machine used meanwhile (all
busy time in /proc/stat minus the server's process tree, h2load and this
script), in cores: on a shared 2-core machine, read a point with a high
value as noisy.

The runtime under test runs with its defaults (only ports and private
folders are set, plus WORKERS_WARM=2, which is the default the test harness
lowers to 1). Benchmarks report, they do not fail: a missed target is MISS,
exit code 0; the exit code is 1 only when a point could not be measured.

usage: scripts/bench_dataplane.py [--peer mlserver] [--duration S] [--warmup S] [--rounds N] [--json PATH]
       (scripts/bench runs it after its own table; scripts/bench --dataplane-only runs only this)
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import math
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

import grpc  # noqa: E402
import harness  # noqa: E402  (tests/harness.py)
import numpy as np  # noqa: E402
import psutil  # noqa: E402

from protos import grpc_predict_v2_pb2 as pb  # noqa: E402
from protos import grpc_predict_v2_pb2_grpc as pb_grpc  # noqa: E402

METHOD = "/inference.GRPCInferenceService/ModelInfer"
MiB = 1024 * 1024
BIG_ELEMENTS = MiB // 4  # FP32 [1, 262144]: 1 MiB of raw_input_contents
IRIS_ROW = [5.1, 3.5, 1.4, 0.2]  # a setosa: LogisticRegression says class 0
CONCURRENCY = (1, 16)
CHECK_CALLS = 20
POST_CHECK_CALLS = 5
MLSERVER_VERSION = "1.7.1"
MLSERVER_VENV = os.path.join(REPO, ".bench", "mlserver-venv")
RUNTIME_ENV = {"WORKERS_WARM": "2"}  # the product default (the test harness lowers it to 1)
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)]

# The two payloads.
SMALL, BIG = "FP32 [1,4]", "1 MiB raw"


class CheckFailed(Exception):
    """A point whose responses are not what they should be: no figure is reported for it."""


def progress(text: str) -> None:
    print(f"  .. {text}", file=sys.stderr, flush=True)


def percentile(samples: list[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


# -- tools ------------------------------------------------------------------------------


def ensure_h2load() -> str:
    """h2load's path; installs nghttp2-client with apt-get when it is missing."""
    if shutil.which("h2load") is None or shutil.which("nghttp") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise RuntimeError("h2load is missing: install the Debian package nghttp2-client")
        progress("installing h2load (apt-get install nghttp2-client)")
        subprocess.run(
            "apt-get update -q && apt-get install -y -q nghttp2-client",
            shell=True,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    version = subprocess.run(["h2load", "--version"], capture_output=True, text=True).stdout.strip()
    return version.replace("h2load ", "")


def ensure_mlserver() -> str:
    """The mlserver executable in .bench/mlserver-venv, installed there on first use."""
    stamp = os.path.join(MLSERVER_VENV, f".installed-mlserver-{MLSERVER_VERSION}")
    executable = os.path.join(MLSERVER_VENV, "bin", "mlserver")
    if os.path.exists(stamp) and os.path.exists(executable):
        return executable
    progress(
        f"installing mlserver=={MLSERVER_VERSION} mlserver-sklearn into .bench/mlserver-venv "
        "(a few minutes, once)"
    )
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    log_path = os.path.join(REPO, ".bench", "mlserver-install.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:
        steps = [
            [base, "-m", "venv", MLSERVER_VENV],
            [
                os.path.join(MLSERVER_VENV, "bin", "python"),
                "-m",
                "pip",
                "install",
                "-q",
                f"mlserver=={MLSERVER_VERSION}",
                f"mlserver-sklearn=={MLSERVER_VERSION}",
            ],
        ]
        for step in steps:
            if subprocess.run(step, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                with open(log_path) as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(
                    f"installing MLServer failed ({' '.join(step[-3:])}); log {log_path}:\n{tail}"
                )
    open(stamp, "w").close()
    return executable


def package_version(python: str, name: str) -> str:
    found = subprocess.run(
        [python, "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
        capture_output=True,
        text=True,
    )
    return found.stdout.strip() or "?"


# -- requests and expected answers ----------------------------------------------------------


def small_request(model_name: str) -> bytes:
    request = pb.ModelInferRequest(model_name=model_name)
    request.inputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend(IRIS_ROW)
    return request.SerializeToString()


def big_values() -> np.ndarray:
    return (np.arange(BIG_ELEMENTS, dtype=np.float32) % 1000) / 8


def big_request(model_name: str) -> bytes:
    request = pb.ModelInferRequest(model_name=model_name)
    request.inputs.add(name="x", datatype="FP32", shape=[1, BIG_ELEMENTS])
    request.raw_input_contents.append(big_values().tobytes())
    return request.SerializeToString()


def echo_response(model_name: str, big: bool) -> bytes:
    """What the echo model answers (the canned server's fixed answer, same size)."""
    response = pb.ModelInferResponse(model_name=model_name)
    if big:
        response.outputs.add(name="x", datatype="FP32", shape=[1, BIG_ELEMENTS])
        response.raw_output_contents.append(big_values().tobytes())
    else:
        response.outputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend(IRIS_ROW)
    return response.SerializeToString()


def output_values(response: pb.ModelInferResponse, index: int = 0) -> np.ndarray:
    out = response.outputs[index]
    if response.raw_output_contents:
        dtype = {"FP32": np.float32, "INT64": np.int64, "INT32": np.int32, "FP64": np.float64}[out.datatype]
        return np.frombuffer(response.raw_output_contents[index], dtype=dtype)
    for field in ("fp32_contents", "int64_contents", "int_contents", "fp64_contents"):
        values = getattr(out.contents, field)
        if len(values):
            return np.asarray(values)
    return np.asarray([])


def expect_echo(big: bool):
    wanted = big_values() if big else np.asarray(IRIS_ROW, dtype=np.float32)

    def check(response: pb.ModelInferResponse) -> None:
        if not response.outputs:
            raise CheckFailed("the response has no output")
        got = output_values(response)
        if got.shape != wanted.shape or not np.array_equal(got.astype(np.float32), wanted):
            raise CheckFailed(f"echo returned {got[:4]}... ({got.size} values), not the input")

    return check


def expect_iris(response: pb.ModelInferResponse) -> None:
    names = [o.name for o in response.outputs]
    if "predict" not in names:
        raise CheckFailed(f"the response has outputs {names}, no 'predict'")
    got = output_values(response, names.index("predict"))
    if got.tolist() != [0]:
        raise CheckFailed(f"iris predict returned {got.tolist()}, expected [0] (setosa)")


def expect_anything(response: pb.ModelInferResponse) -> None:
    pass


def grpc_body(message: bytes) -> bytes:
    return b"\0" + struct.pack(">I", len(message)) + message


def mesh_header_lines(model_id: str) -> list[tuple[str, str]]:
    """model-mesh's headers as HTTP/2 header lines (binary values travel base64, unpadded)."""
    lines = [("mm-model-id-bin", base64.b64encode(model_id.encode()).decode().rstrip("="))]
    if all(32 <= ord(c) <= 126 for c in model_id):
        lines.append(("mm-model-id", model_id))
    return lines


# -- one measured point -----------------------------------------------------------------------


class Target:
    """A server to measure: where it listens, the body to send, the headers, what a good answer is."""

    count = 0

    def __init__(
        self,
        case: str,
        payload: str,
        port: int,
        message: bytes,
        headers: list[tuple[str, str]],
        expect,
        processes,
        folder: str,
        note: str = "",
    ):
        self.case, self.payload, self.port = case, payload, port
        self.message, self.headers, self.expect = message, headers, expect
        self.processes = processes  # () -> list[psutil.Process]: the server's tree, for its CPU
        self.note = note
        Target.count += 1
        self.body_path = os.path.join(folder, f"body-{Target.count}.bin")
        with open(self.body_path, "wb") as f:
            f.write(grpc_body(message))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{METHOD}"


def python_calls(target: Target, calls: int) -> set[int]:
    """`calls` ModelInfer calls with the exact bytes and headers h2load sends; their response sizes."""
    metadata = []
    for name, value in target.headers:
        metadata.append((name, base64.b64decode(value + "==") if name.endswith("-bin") else value))
    sizes = set()
    with grpc.insecure_channel(f"127.0.0.1:{target.port}", options=GRPC_OPTIONS) as channel:
        call = channel.unary_unary(METHOD)  # no serialisers: bytes in, bytes out
        for _ in range(calls):
            try:
                answer = call(target.message, metadata=metadata, timeout=30)
            except grpc.RpcError as error:
                raise CheckFailed(f"grpc status {error.code().name}: {error.details()}") from None
            target.expect(pb.ModelInferResponse.FromString(answer))
            sizes.add(len(answer))
    return sizes


def nghttp_check(target: Target) -> None:
    """The exact body file h2load sends gets grpc-status 0 (seen by another HTTP/2 client)."""
    command = [
        "nghttp",
        "-v",
        "-n",
        "-d",
        target.body_path,
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
        *sum((["-H", f"{k}: {v}"] for k, v in target.headers), []),
        target.url,
    ]
    run = subprocess.run(command, capture_output=True, text=True, timeout=60)
    status = re.findall(r"recv \(stream_id=\d+\) grpc-status: (\d+)", run.stdout)
    message = re.findall(r"recv \(stream_id=\d+\) grpc-message: (.*)", run.stdout)
    if status != ["0"]:
        raise CheckFailed(
            f"nghttp with h2load's body got grpc-status {status or 'none'} "
            f"{message[:1]} (exit {run.returncode})"
        )


def h2load_command(target: Target, concurrency: int, *limit: str) -> list[str]:
    """h2load sending target's body as gRPC calls on `concurrency` connections; limit: -D TIME or -n CALLS."""
    return [
        "h2load",
        "-c",
        str(concurrency),
        "-m",
        "1",
        "-t",
        "1",
        *limit,
        "-d",
        target.body_path,
        "-H",
        "content-type: application/grpc",
        "-H",
        "te: trailers",
        *sum((["-H", f"{k}: {v}"] for k, v in target.headers), []),
    ]


def h2load(target: Target, concurrency: int, seconds: float, log_path: str | None) -> dict:
    command = h2load_command(target, concurrency, "-D", f"{round(seconds * 1000)}ms")
    if log_path:
        command += ["--log-file", log_path]
    run = subprocess.run([*command, target.url], capture_output=True, text=True, timeout=seconds + 60)
    out = run.stdout
    finished = re.search(r"finished in ([\d.]+)(?:s|ms|us), ([\d.]+) req/s", out)
    requests = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
        r"(\d+) failed, (\d+) errored, (\d+) timeout",
        out,
    )
    codes = re.search(r"status codes: (\d+) 2xx", out)
    data = re.search(r"\((\d+)\) data", out)
    if run.returncode != 0 or not (finished and requests and codes and data):
        raise CheckFailed(f"h2load failed (exit {run.returncode}): {(out + run.stderr)[-600:]}")
    done, succeeded, failed, errored, timeout = (int(requests.group(i)) for i in (3, 4, 5, 6, 7))
    return {
        "req_s": float(finished.group(2)),
        "done": done,
        "succeeded": succeeded,
        "failed": failed,
        "errored": errored,
        "timeout": timeout,
        "ok_2xx": int(codes.group(1)),
        "data_bytes": int(data.group(1)),
        "command": " ".join(command + [target.url]),
    }


def busy_jiffies() -> int:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal


def tree_cpu(processes: list[psutil.Process]) -> dict[int, float]:
    seconds = {}
    for process in processes:
        try:
            times = process.cpu_times()
            seconds[process.pid] = times.user + times.system
        except psutil.Error:
            pass
    return seconds


def measure(target: Target, concurrency: int, duration: float, warmup: float, folder: str) -> dict:
    """One point: checks, warm-up, the measured h2load run, checks again."""
    sizes = python_calls(target, CHECK_CALLS)
    nghttp_check(target)
    if warmup > 0:
        h2load(target, concurrency, warmup, None)
    log_path = os.path.join(folder, f"h2load-{os.path.basename(target.body_path)}-c{concurrency}.tsv")
    if os.path.exists(log_path):
        os.remove(log_path)
    servers = target.processes()
    cpu_before, busy_before = tree_cpu(servers), busy_jiffies()
    self_before = os.times()
    run = h2load(target, concurrency, duration, log_path)
    busy_after, cpu_after, self_after = busy_jiffies(), tree_cpu(servers), os.times()
    python_calls(target, POST_CHECK_CALLS)

    bad = run["failed"] + run["errored"] + run["timeout"]
    # With -D, a response whose headers arrived as the time ran out counts as
    # 2xx but not done: up to one per connection.
    if bad or not run["done"] <= run["ok_2xx"] <= run["done"] + concurrency or run["done"] == 0:
        raise CheckFailed(
            f"h2load: {run['done']} done, {run['ok_2xx']} 2xx, {run['failed']} failed, "
            f"{run['errored']} errored, {run['timeout']} timeout"
        )
    # Every response must have carried a whole message: a gRPC error has no DATA at all.
    low, high = (min(sizes) + 5) * run["done"], (max(sizes) + 5) * run["ok_2xx"]
    if not low <= run["data_bytes"] <= high:
        raise CheckFailed(
            f"h2load received {run['data_bytes']} DATA bytes for {run['done']} responses of "
            f"{sorted(sizes)} bytes: some calls did not return a ModelInferResponse"
        )
    latencies = []
    with open(log_path) as f:
        for line in f:
            start_us, status, elapsed_us = line.split("\t")[:3]
            if status == "200":
                latencies.append(int(elapsed_us) / 1000)
    if len(latencies) < run["done"] * 0.99:
        raise CheckFailed(f"h2load's log holds {len(latencies)} requests, it reported {run['done']}")

    hz = os.sysconf("SC_CLK_TCK")
    elapsed = self_after.elapsed - self_before.elapsed
    server_cpu = sum(cpu_after.get(pid, 0) - cpu_before.get(pid, 0) for pid in cpu_before)
    h2load_cpu = (
        self_after.children_user
        + self_after.children_system
        - self_before.children_user
        - self_before.children_system
    )
    own_cpu = self_after.user + self_after.system - self_before.user - self_before.system
    machine_cpu = (busy_after - busy_before) / hz
    per_process = {}
    for process in servers:
        if process.pid in cpu_before:
            name = " ".join(_cmdline(process))[:60]
            per_process[name] = round(
                (cpu_after.get(process.pid, 0) - cpu_before[process.pid]) / run["done"] * 1e6, 1
            )
    return {
        "case": target.case,
        "payload": target.payload,
        "concurrency": concurrency,
        "req_s": run["req_s"],
        "requests": run["done"],
        "p50_ms": percentile(latencies, 50),
        "p99_ms": percentile(latencies, 99),
        "mean_ms": sum(latencies) / len(latencies),
        "response_bytes": sorted(sizes),
        "server_cpu_us_per_req": server_cpu / run["done"] * 1e6,
        "server_cpu_us_per_req_by_process": per_process,
        "server_cores": server_cpu / elapsed,
        "h2load_cores": h2load_cpu / elapsed,
        "other_cores": max(0.0, (machine_cpu - server_cpu - h2load_cpu - own_cpu) / elapsed),
        "checked": f"{CHECK_CALLS}+{POST_CHECK_CALLS} grpc calls, nghttp, DATA bytes",
        "h2load_command": run["command"],
    }


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline()
    except psutil.Error:
        return []


# -- the servers ------------------------------------------------------------------------------


def wait_port(port: int, process: subprocess.Popen, log_path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
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


class Canned:
    """scripts/canned_server.py in a subprocess, answering with `response`."""

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
            [
                sys.executable,
                os.path.join(REPO, "scripts", "canned_server.py"),
                "--port",
                str(self.port),
                "--response",
                self.response_path,
                *(["--hop"] if self.hop else []),
                *(["--uvloop"] if self.uvloop else []),
            ],
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
    """Returns its inputs as outputs (the 1 MiB case of scripts/bench_dataplane.py)."""

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


# -- the plan ---------------------------------------------------------------------------------

CASE_A, CASE_B, CASE_C = "(a) grpc.aio canned", "(b) mesh-runtime echo", "(c) mesh-runtime sklearn"
CASE_A2 = "(a2) canned via a ZeroMQ hop"
CASE_A_UVLOOP = "(a') grpc.aio canned, uvloop"
CASE_D_SKLEARN, CASE_D_ECHO = "(d) MLServer sklearn", "(d) MLServer echo"
# Every (case, payload) in the order the table shows them.
ROWS = (
    (CASE_A, SMALL),
    (CASE_A, BIG),
    (CASE_A_UVLOOP, SMALL),
    (CASE_A2, SMALL),
    (CASE_B, SMALL),
    (CASE_B, BIG),
    (CASE_C, SMALL),
    (CASE_D_SKLEARN, SMALL),
    (CASE_D_ECHO, BIG),
)


def run(
    duration: float = 8.0, warmup: float = 1.0, peer: str | None = None, rounds: int = 1
) -> tuple[dict, bool]:
    """Measures every point; returns (figures, ok). ok is False when a point could not be measured.

    Every server is started first and the points are interleaved (for each
    payload and concurrency: a, b, c, d), so that a burst of other work on
    the machine hits the cases being compared alike. With rounds > 1 the
    whole sequence repeats and each point reports its round of median req/s.
    """
    started = time.monotonic()
    folder = tempfile.mkdtemp(prefix="mr-dataplane-")
    figures: dict = {
        "duration_s": duration,
        "warmup_s": warmup,
        "rounds": rounds,
        "points": [],
        "notes": [],
        "peer": peer,
        "runtime_env": dict(RUNTIME_ENV),
    }
    failed: dict[tuple[str, str], str] = {}  # (case, payload) -> why it has no figures
    targets_: list[Target] = []

    def cannot(rows: tuple[tuple[str, str], ...], error: BaseException) -> None:
        traceback.print_exc()
        for row in rows:
            if row not in failed and not any((t.case, t.payload) == row for t in targets_):
                failed[row] = repr(error)[:200]
                print(f"ERROR {row[0]} {row[1]}: {error!r}", file=sys.stderr)

    figures["h2load"] = ensure_h2load()
    figures["load_average_before"] = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        # (a) the ceiling of a Python front: one canned server per payload
        for payload, big in ((SMALL, False), (BIG, True)):
            try:
                canned = stack.enter_context(
                    Canned(folder, "big" if big else "small", echo_response("echo", big))
                )
                targets_.append(
                    Target(
                        CASE_A,
                        payload,
                        canned.port,
                        big_request("echo") if big else small_request("echo"),
                        mesh_header_lines("echo"),
                        expect_anything,
                        canned.processes,
                        folder,
                    )
                )
            except Exception as error:
                cannot(((CASE_A, payload),), error)
        # (a') the same on uvloop, the event loop mesh-runtime's front runs on (a reference)
        try:
            canned = stack.enter_context(Canned(folder, "uvloop", echo_response("echo", False), uvloop=True))
            targets_.append(
                Target(
                    CASE_A_UVLOOP,
                    SMALL,
                    canned.port,
                    small_request("echo"),
                    mesh_header_lines("echo"),
                    expect_anything,
                    canned.processes,
                    folder,
                )
            )
        except Exception as error:
            cannot(((CASE_A_UVLOOP, SMALL),), error)
        # (a2) behind one ZeroMQ hop, on uvloop as mesh-runtime's front
        try:
            hop = stack.enter_context(
                Canned(folder, "hop", echo_response("echo", False), hop=True, uvloop=True)
            )
            targets_.append(
                Target(
                    CASE_A2,
                    SMALL,
                    hop.port,
                    small_request("echo"),
                    mesh_header_lines("echo"),
                    expect_anything,
                    hop.processes,
                    folder,
                )
            )
        except Exception as error:
            cannot(((CASE_A2, SMALL),), error)

        # (b) and (c): one runtime with its defaults, serving echo and iris
        rt = harness.Runtime(preload_frameworks=True, **RUNTIME_ENV)
        stack.callback(_stop_runtime, rt)
        try:
            progress("starting mesh-runtime, loading echo and iris")
            rt.start()
            rt.load("echo", rt.model_dir("echo"))
            runtime_tree = lambda: harness.tree(rt.pid)  # noqa: E731
            for payload, big in ((SMALL, False), (BIG, True)):
                targets_.append(
                    Target(
                        CASE_B,
                        payload,
                        rt.port,
                        big_request("echo") if big else small_request("echo"),
                        mesh_header_lines("echo"),
                        expect_echo(big),
                        runtime_tree,
                        folder,
                    )
                )
            figures["iris_served_as"] = load_iris_model(rt)
            targets_.append(
                Target(
                    CASE_C,
                    SMALL,
                    rt.port,
                    small_request("iris"),
                    mesh_header_lines("iris"),
                    expect_iris,
                    runtime_tree,
                    folder,
                    note=figures["iris_served_as"],
                )
            )
        except Exception as error:
            cannot(((CASE_B, SMALL), (CASE_B, BIG), (CASE_C, SMALL)), error)
            if rt.process is not None:
                print(f"runtime log ({rt.log_path}), its end:\n{rt.log()[-3000:]}", file=sys.stderr)

        # (d) the peer
        if peer == "mlserver":
            try:
                iris = os.path.join(folder, "iris.joblib")
                train_iris(iris)
                server = MLServer(folder, iris)
                python = os.path.join(MLSERVER_VENV, "bin", "python")
                figures["notes"].append(
                    f"peer: MLServer {package_version(python, 'mlserver')}, mlserver-sklearn "
                    f"{package_version(python, 'mlserver-sklearn')}, scikit-learn "
                    f"{package_version(python, 'scikit-learn')} "
                    f"(ours {package_version(sys.executable, 'scikit-learn')}); "
                    "settings.json: parallel_workers 0, ports; the rest default; 1 MiB: an echo MLModel"
                )
                progress("starting MLServer")
                stack.enter_context(server)
                targets_.append(
                    Target(
                        CASE_D_SKLEARN,
                        SMALL,
                        server.port,
                        small_request("iris"),
                        [],
                        expect_iris,
                        server.processes,
                        folder,
                    )
                )
                targets_.append(
                    Target(
                        CASE_D_ECHO,
                        BIG,
                        server.port,
                        big_request("echo"),
                        [],
                        expect_echo(True),
                        server.processes,
                        folder,
                        note="custom MLModel returning its inputs",
                    )
                )
            except Exception as error:
                cannot(((CASE_D_SKLEARN, SMALL), (CASE_D_ECHO, BIG)), error)

        figures["seconds_setup"] = time.monotonic() - started
        results: dict[tuple[str, str, int], list[dict]] = {}
        for round_ in range(rounds):
            for payload in (SMALL, BIG):
                for c in CONCURRENCY:
                    for target in targets_:
                        if target.payload != payload:
                            continue
                        progress(
                            f"{target.case} {payload} c={c}"
                            + (f" (round {round_ + 1})" if rounds > 1 else "")
                        )
                        try:
                            result = measure(target, c, duration, warmup, folder)
                        except Exception as error:
                            message = str(error) if isinstance(error, CheckFailed) else repr(error)
                            print(f"ERROR {target.case} {payload} c={c}: {message}", file=sys.stderr)
                            if not isinstance(error, CheckFailed):
                                traceback.print_exc()
                            result = {"error": message}
                        results.setdefault((target.case, payload, c), []).append(result)

    for case, payload in ROWS:
        if case.startswith("(d)") and peer is None:
            continue
        for c in CONCURRENCY:
            key = {"case": case, "payload": payload, "concurrency": c}
            runs = results.get((case, payload, c))
            if runs is None:
                figures["points"].append({**key, "error": failed.get((case, payload), "not measured")})
            elif any("error" in r for r in runs):
                figures["points"].append({**key, "error": next(r["error"] for r in runs if "error" in r)})
            else:
                chosen = sorted(runs, key=lambda r: r["req_s"])[len(runs) // 2]
                figures["points"].append({**chosen, **key, "rounds_req_s": [r["req_s"] for r in runs]})
    ok = not any("error" in p for p in figures["points"])
    figures["seconds"] = time.monotonic() - started
    if ok:
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"data-plane files kept: {folder}", file=sys.stderr)
    figures["targets"] = targets(figures["points"], peer)
    return figures, ok


def _stop_runtime(rt: harness.Runtime) -> None:
    if rt.process is None:
        return
    try:
        rt.stop()
    except Exception as error:
        print(f"warning: stopping the runtime: {error!r} (log: {rt.log_path})", file=sys.stderr)


# -- targets and the table ---------------------------------------------------------------------


def _find(points: list[dict], case_prefix: str, payload: str, c: int) -> dict | None:
    for p in points:
        if p["case"].startswith(case_prefix) and p["payload"] == payload and p["concurrency"] == c:
            return None if "error" in p else p
    return None


def targets(points: list[dict], peer: str | None) -> list[dict]:
    """The issue's targets: each with its value, or why it has none."""

    def ratio(name, num, den, c, payload, goal, peer_needed=False):
        """goal None: a ratio shown for reading the others, with no target of its own."""
        a, b = _find(points, num, payload, c), _find(points, den, payload, c)
        if goal is None:
            target = "(reference)"
        else:
            target = f">= {goal:g}x" if goal >= 1 else f">= {goal:.0%}"
        row = {"measure": name, "target": target}
        if a and b:
            value = a["req_s"] / b["req_s"]
            show = (lambda v: f"{v:.2f}x") if goal and goal >= 1 else (lambda v: f"{v:.0%}")
            # With --rounds, the same ratio within each round too (rounds are interleaved,
            # so a burst of noise hits both sides of a round alike).
            rounds = zip(a.get("rounds_req_s", []), b.get("rounds_req_s", []), strict=False)
            per_round = [x / y for x, y in rounds]
            shown = show(value) + (
                f" (rounds: {' '.join(map(show, per_round))})" if len(per_round) > 1 else ""
            )
            verdict = "" if goal is None else "PASS" if value >= goal else "MISS"
            row.update(value=value, rounds=per_round, shown=shown, verdict=verdict)
        else:
            row.update(
                value=None,
                shown="n/a",
                verdict="" if peer_needed and not peer else "n/a",
                why="needs --peer mlserver" if peer_needed and not peer else "a point failed",
            )
        return row

    rows = [
        ratio("(b) / (a) req/s, FP32 [1,4], c=16", "(b)", "(a)", 16, SMALL, 0.60),
        ratio("(c) / (d) req/s, FP32 [1,4], c=16", "(c)", "(d)", 16, SMALL, 3, True),
    ]
    a, b = _find(points, "(a)", SMALL, 1), _find(points, "(b)", SMALL, 1)
    row = {"measure": "p50 (b) - p50 (a), FP32 [1,4], c=1", "target": "<= 0.40 ms"}
    if a and b:
        value = b["p50_ms"] - a["p50_ms"]
        row.update(value=value, shown=f"{value:+.3f} ms", verdict="PASS" if value <= 0.4 else "MISS")
    else:
        row.update(value=None, shown="n/a", verdict="n/a", why="a point failed")
    rows.append(row)
    rows.append(ratio("(b) / (a) req/s, 1 MiB, c=16", "(b)", "(a)", 16, BIG, 0.45))
    rows.append(ratio("(b) / (d) req/s, 1 MiB, c=16", "(b)", "(d)", 16, BIG, 5, True))
    # References: what uvloop alone gives (a), what the bare hop keeps of it, and what
    # mesh-runtime keeps of the hop.
    rows.append(ratio("(a') / (a) req/s, FP32 [1,4], c=16", "(a')", "(a)", 16, SMALL, None))
    rows.append(ratio("(b) / (a') req/s, FP32 [1,4], c=16", "(b)", "(a')", 16, SMALL, None))
    rows.append(ratio("(a2) / (a') req/s, FP32 [1,4], c=16", "(a2)", "(a')", 16, SMALL, None))
    rows.append(ratio("(b) / (a2) req/s, FP32 [1,4], c=16", "(b)", "(a2)", 16, SMALL, None))
    return rows


def print_report(figures: dict) -> None:
    print()
    rounds = f", median of {figures['rounds']} rounds" if figures["rounds"] > 1 else ""
    print(
        f"data plane: ModelInfer under h2load {figures['h2load']} (-m 1, -t 1), "
        f"{figures['duration_s']:g} s per point after a {figures['warmup_s']:g} s warm-up run, "
        f"cases interleaved{rounds}"
    )
    print(
        f"runtime under test: defaults ({', '.join(f'{k}={v}' for k, v in figures['runtime_env'].items())}, "
        f"MODEL_REPLICAS=1, WORKER_THREADS=1, LOG_LEVEL=info); "
        f"iris served by the {figures.get('iris_served_as', '?')}"
    )
    for note in figures["notes"]:
        print(note)
    print(
        f"each point: h2load -c C -m 1 -t 1 -D {figures['duration_s']:g}s -d BODY "
        "-H 'content-type: application/grpc' -H 'te: trailers' "
        "-H 'mm-model-id-bin: B64' -H 'mm-model-id: ID' http://127.0.0.1:PORT/inference.GRPCInferenceService/ModelInfer"
        " --log-file LOG (MLServer: no mm- headers, the model name in the request)"
    )
    print(f"load average before: {figures['load_average_before']:.2f}")
    header = ("case", "payload", "c", "req/s", "p50 ms", "p99 ms", "srv cpu/req", "other cpu")
    rows = []
    for p in figures["points"]:
        if "error" in p:
            rows.append(
                (p["case"], p["payload"], str(p["concurrency"]), "ERROR", p["error"][:70], "", "", "")
            )
        else:
            rows.append(
                (
                    p["case"],
                    p["payload"],
                    str(p["concurrency"]),
                    f"{p['req_s']:,.0f}",
                    f"{p['p50_ms']:.3f}",
                    f"{p['p99_ms']:.3f}",
                    f"{p['server_cpu_us_per_req']:.0f} us",
                    f"{p['other_cores']:.2f} cores",
                )
            )
    _table(header, rows)
    print()
    print("targets (issue 3, item 7)")
    _table(
        ("measure", "value", "target", ""),
        [
            (t["measure"], t["shown"], t["target"], t["verdict"] or (f"({t['why']})" if t.get("why") else ""))
            for t in figures["targets"]
        ],
    )
    print(
        "\nsrv cpu/req: CPU time of the server's processes per request (mesh-runtime: front, fork server and "
        "workers); other cpu: what the rest of the machine used meanwhile"
    )
    print(
        f"check of every point: {CHECK_CALLS} grpc calls before and {POST_CHECK_CALLS} after it "
        "(status OK, expected outputs), nghttp grpc-status 0 for h2load's body, DATA bytes = "
        "requests x response size"
    )
    print(
        f"data-plane section: {figures['seconds']:.0f} s ({figures['seconds_setup']:.0f} s of it "
        "starting servers and loading models)"
    )


def _table(header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    numeric = {2, 3, 4, 5, 6, 7} if len(header) == 8 else set()

    def show(row):
        cells = [
            str(c).rjust(w) if i in numeric and row is not header else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())

    show(header)
    print("  ".join("-" * w for w in widths))
    for row in rows:
        show(row)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--peer",
        choices=["mlserver"],
        help="also measure MLServer 1.7.1 (installs it into .bench/mlserver-venv on first use)",
    )
    parser.add_argument("--duration", type=float, default=8.0, help="seconds measured per point (default 8)")
    parser.add_argument(
        "--warmup", type=float, default=1.0, help="seconds of warm-up run per point (default 1)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat the interleaved sequence; each point reports its median round (default 1)",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args()
    try:
        figures, ok = run(args.duration, args.warmup, args.peer, args.rounds)
    except Exception:
        traceback.print_exc()
        return 1
    print_report(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
        print(f"\nfigures written to {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
