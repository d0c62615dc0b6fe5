"""One measured point: h2load driving gRPC calls at a server, its output parsed and checked.

h2load POSTs a length-prefixed protobuf body with `content-type: application/grpc`,
`te: trailers` and model-mesh's headers, one stream at a time per connection (-m 1).
It counts HTTP 200 only, and gRPC answers errors with HTTP 200 too, so every point is checked
three ways: before it, 20 calls through a Python grpc channel with the same bytes and headers
must return status OK and the expected outputs, and nghttp must see `grpc-status: 0` for the
exact body file h2load sends; during it, the DATA bytes h2load received must equal
(requests x framed response size), which no error response (it has no message) can fake;
after it, 5 more Python calls must succeed. A point that fails a check raises CheckFailed.

Each point is a warm-up run, then the measured run. req/s is h2load's; p50/p99 are
nearest-rank percentiles of its per-request log (--log-file; h2load itself prints only
mean/sd/max). `other_cores` is the CPU the rest of the machine used meanwhile (all busy time
in /proc/stat minus the server's process tree, h2load and this process).
"""

from __future__ import annotations

import base64
import os
import re
import subprocess

import grpc
import psutil

from bench.common import MiB, cmdline, percentile
from bench.payloads import METHOD, CheckFailed, grpc_body
from protos import grpc_predict_v2_pb2 as pb

CHECK_CALLS = 20
POST_CHECK_CALLS = 5
GRPC_OPTIONS = [("grpc.max_send_message_length", 64 * MiB), ("grpc.max_receive_message_length", 64 * MiB)]


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
    command = ["nghttp", "-v", "-n", *grpc_body_arguments(target), target.url]
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
        *grpc_body_arguments(target),
    ]


def grpc_body_arguments(target: Target) -> list[str]:
    """The body file and the headers that make an HTTP/2 client's request a gRPC call (h2load, nghttp)."""
    headers = [("content-type", "application/grpc"), ("te", "trailers"), *target.headers]
    return ["-d", target.body_path, *(part for name, value in headers for part in ("-H", f"{name}: {value}"))]


def run_h2load(target: Target, concurrency: int, seconds: float, log_path: str | None) -> dict:
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


def tree_faults(processes: list[psutil.Process]) -> dict[int, int]:
    """Page faults (minor and major) each process has taken, from /proc/PID/stat."""
    faults = {}
    for process in processes:
        try:
            with open(f"/proc/{process.pid}/stat") as stat:
                # After the command (in parentheses, may hold spaces): state is field 3, minflt 10, majflt 12.
                fields = stat.read().rsplit(")", 1)[1].split()
            faults[process.pid] = int(fields[7]) + int(fields[9])
        except (OSError, IndexError, ValueError):
            pass
    return faults


def measure(target: Target, concurrency: int, duration: float, warmup: float, folder: str) -> dict:
    """One point: checks, warm-up, the measured h2load run, checks again."""
    sizes = python_calls(target, CHECK_CALLS)
    nghttp_check(target)
    if warmup > 0:
        run_h2load(target, concurrency, warmup, None)
    log_path = os.path.join(folder, f"h2load-{os.path.basename(target.body_path)}-c{concurrency}.tsv")
    if os.path.exists(log_path):
        os.remove(log_path)
    servers = target.processes()
    cpu_before, busy_before, faults_before = tree_cpu(servers), busy_jiffies(), tree_faults(servers)
    self_before = os.times()
    run = run_h2load(target, concurrency, duration, log_path)
    busy_after, cpu_after, self_after = busy_jiffies(), tree_cpu(servers), os.times()
    faults_after = tree_faults(servers)
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
            name = " ".join(cmdline(process))[:60]
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
        "page_faults_per_req": sum(faults_after.get(p, 0) - n for p, n in faults_before.items())
        / run["done"],
        "server_cpu_us_per_req_by_process": per_process,
        "server_cores": server_cpu / elapsed,
        "h2load_cores": h2load_cpu / elapsed,
        "other_cores": max(0.0, (machine_cpu - server_cpu - h2load_cpu - own_cpu) / elapsed),
        "checked": f"{CHECK_CALLS}+{POST_CHECK_CALLS} grpc calls, nghttp, DATA bytes",
        "h2load_command": run["command"],
    }
