"""Instructions per ModelInfer call, counted by valgrind's callgrind: a figure that does not swing.

On this shared 2-core machine req/s of the same build moves by a third
between runs, which hides any change worth less than that. The number of
instructions a process executes per call barely moves (under 1 % between
runs), so this benchmark counts them, for the processes that do the work:

  (a)  bench/canned_server.py, the bare grpc.aio server of the data-plane bench
  (a2) its --hop variant's front, on uvloop as mesh-runtime's front (the child
       that answers is not counted)
  (b)  mesh-runtime's front process serving the echo model (default event
       loop, uvloop; BUSY_POLL_US=0, so that polling, which only burns idle
       time, is not counted)
  (w)  mesh-runtime's echo worker alone, sent calls over its call lane by
       this script, three in flight (no front, no grpc)

Each server runs under callgrind; after a warm-up its counters are zeroed,
N calls run (h2load, 16 connections; the worker: this script), the counters
are dumped, and the total is divided by N. Instructions are not time (a
system call or a cache miss costs more than an add), but fewer of them for
the same calls is less work, and the figure moves only when the code does.
valgrind is installed with apt-get when it is missing and we are root.

usage: .venv/bin/python -m bench.instructions [--calls N] [--json PATH]
       (or scripts/bench --instructions-only)
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import zmq

from bench.common import REPO, progress
from bench.h2load import Target, h2load_command
from bench.installers import ensure_h2load, ensure_valgrind
from bench.payloads import SMALL, echo_response, expect_anything, mesh_header_lines, small_request
from bench.servers import RUNTIME_ENV, canned_command, stop_process, wait_port
from meshtest import harness
from workers import lanes, protocol

WARMUP_CALLS = 300
WORKER_IN_FLIGHT = 3


def callgrind(folder: str, name: str) -> tuple[str, ...]:
    return ("valgrind", "--tool=callgrind", f"--callgrind-out-file={folder}/{name}.%p")


class Counted:
    """The counters of one process under callgrind: zero them, then read how many ran since."""

    def __init__(self, folder: str, name: str, pid: int):
        self.folder, self.name, self.pid = folder, name, pid

    def zero(self) -> None:
        self._control("-z")

    def instructions_since_zero(self) -> int:
        self._control("-d")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            for path in glob.glob(f"{self.folder}/{self.name}.{self.pid}.*"):
                with open(path) as f:
                    for line in f:
                        if line.startswith(("summary:", "totals:")):
                            return int(line.split()[1])
            time.sleep(0.2)
        raise RuntimeError(f"callgrind wrote no dump for {self.name} (pid {self.pid})")

    def _control(self, flag: str) -> None:
        run = subprocess.run(["callgrind_control", flag, str(self.pid)], capture_output=True, text=True)
        if "OK" not in run.stdout:
            raise RuntimeError(
                f"callgrind_control {flag} {self.pid}: {run.stdout.strip()} {run.stderr.strip()}"
            )


def h2load_calls(port: int, calls: int, folder: str) -> None:
    target = Target(
        "x",
        SMALL,
        port,
        small_request("echo"),
        mesh_header_lines("echo"),
        expect_anything,
        None,
        folder,
    )
    command = [*h2load_command(target, 16, "-n", str(calls)), target.url]
    out = subprocess.run(command, capture_output=True, text=True, timeout=600).stdout
    if f"{calls} succeeded" not in out:
        raise RuntimeError(f"h2load: not every call succeeded:\n{out[-600:]}")


def per_call(counted: Counted, run_calls, calls: int) -> float:
    run_calls(WARMUP_CALLS)
    counted.zero()
    run_calls(calls)
    return counted.instructions_since_zero() / calls


def canned(folder: str, calls: int, hop: bool) -> float:
    name = "hop" if hop else "canned"
    answer = os.path.join(folder, "answer.bin")
    with open(answer, "wb") as f:
        f.write(echo_response("echo", False))
    port = harness.free_port()
    process = subprocess.Popen(
        [*callgrind(folder, name), *canned_command(port, answer, *(["--hop", "--uvloop"] if hop else []))],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(folder, f"{name}.log"), "w"),
        start_new_session=True,
    )
    try:
        wait_port(port, process, os.path.join(folder, f"{name}.log"), 120)
        return per_call(Counted(folder, name, process.pid), lambda n: h2load_calls(port, n, folder), calls)
    finally:
        stop_process(process)


def front(folder: str, calls: int) -> float:
    rt = harness.Runtime(
        command_prefix=callgrind(folder, "front"),
        preload_frameworks=True,
        BUSY_POLL_US="0",
        # valgrind makes the files callgrind_control finds it by in TMPDIR: this script's, not the
        # runtime's own that the harness gives it.
        TMPDIR=tempfile.gettempdir(),
        **RUNTIME_ENV,
    )
    try:
        rt.start(wait_ready=False)
        rt.wait_ready(timeout=300)
        rt.load("echo", rt.model_dir("echo"), timeout=300)
        return per_call(Counted(folder, "front", rt.pid), lambda n: h2load_calls(rt.port, n, folder), calls)
    finally:
        rt.stop()


def worker(folder: str, calls: int) -> float:
    """The echo worker alone: this script is its front, WORKER_IN_FLIGHT calls at a time, over its
    call lane as the front sends them (the load over its socket)."""
    address = f"ipc://{folder}/worker.sock"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(address)
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listening.bind(f"{folder}/lanes.sock")
    listening.listen(1)
    connections: list[socket.socket] = []
    config = {
        "heartbeat_timeout": 3600,
        "identity": b"w",
        "address": address,
        "lanes": f"{folder}/lanes.sock",
        "batch_max": 16,
        "threads": 1,
    }
    code = (
        f"import sys; sys.path[:0] = [{REPO!r}]; from workers.loop import Worker; Worker({config!r}).serve()"
    )
    process = subprocess.Popen(
        [*callgrind(folder, "worker"), sys.executable, "-c", code],
        stderr=open(os.path.join(folder, "worker.log"), "w"),
    )
    try:
        router.recv_multipart()  # hello, after the lane's connection and its first packet
        listening.settimeout(10)
        lane = listening.accept()[0]
        connections.append(lane)
        if lane.recv(lanes.RECEIVE_BYTES) != b"w":
            raise RuntimeError("the worker's lane did not name it")
        path = harness.write_model(os.path.join(folder, "echo"), harness.ECHO_MODEL)
        router.send_multipart(
            [b"w", protocol.header(protocol.OP_LOAD, 1, model_id="echo", format="python", path=path, key="")]
        )
        header, *_ = protocol.split(router.recv_multipart()[1:])
        if not header.get("ok"):
            raise RuntimeError(f"the worker did not load the echo model: {header}")
        body = small_request("echo")
        ids = iter(range(2, 1 << 62))

        def send() -> None:
            header = protocol.header(protocol.OP_CALL, next(ids), method=protocol.METHOD_INFER, deadline=None)
            if not lanes.send(lane, [header, body]):
                raise RuntimeError("the worker's lane took no call")

        def run_calls(n: int) -> None:
            for _ in range(min(n, WORKER_IN_FLIGHT)):
                send()
            for answered in range(1, n + 1):
                header, *_ = protocol.split(lanes.frames_of(lane.recv(lanes.RECEIVE_BYTES)))
                if not header.get("ok"):
                    raise RuntimeError(f"the worker failed a call: {header}")
                if answered + WORKER_IN_FLIGHT <= n:
                    send()

        return per_call(Counted(folder, "worker", process.pid), run_calls, calls)
    finally:
        process.kill()
        process.wait()
        for connection in [*connections, listening]:
            connection.close()
        router.close(linger=0)
        context.term()


def run(calls: int) -> dict:
    figures = {"valgrind": ensure_valgrind(), "h2load": ensure_h2load(), "calls": calls}
    folder = tempfile.mkdtemp(prefix="mr-instructions-")
    cases = [
        ("(a) grpc.aio canned", lambda: canned(folder, calls, hop=False)),
        ("(a2) canned via a ZeroMQ hop: its front", lambda: canned(folder, calls, hop=True)),
        ("(b) mesh-runtime echo: the front", lambda: front(folder, calls)),
        ("(w) mesh-runtime echo: the worker alone", lambda: worker(folder, calls)),
    ]
    figures["cases"] = {}
    for case, measure in cases:
        progress(f"{case} under callgrind ({calls} calls)")
        figures["cases"][case] = round(measure())
    shutil.rmtree(folder, ignore_errors=True)
    return figures


def print_report(figures: dict) -> None:
    print(
        f"\ninstructions per ModelInfer call ({figures['valgrind']} callgrind; {figures['calls']} calls "
        f"after {WARMUP_CALLS}; h2load -c 16 -m 1, the worker alone {WORKER_IN_FLIGHT} in flight)"
    )
    width = max(map(len, figures["cases"]))
    for case, count in figures["cases"].items():
        print(f"  {case:{width}}  {count / 1000:8.1f} k")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls counted per case (default 1000)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON to PATH")
    args = parser.parse_args()
    try:
        figures = run(args.calls)
    except Exception as error:
        print(f"ERROR: {error}", file=sys.stderr)
        return 1
    print_report(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
