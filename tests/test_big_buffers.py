"""plumbing/heap.keep_big_buffers(): big tensors reuse heap pages while calls flow, given back after."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
from harness import MiB, Runtime, mesh_headers, tree, uss, wait_until

from protos import grpc_predict_v2_pb2 as v2

CALLS = 100


def faults_per_megabyte_buffer(keep: bool) -> float:
    """Page faults a fresh process takes per 1 MiB buffer written and freed, three alive at a time (as a
    call's request, its copy and its response are), after small allocations."""
    script = f"""
import resource
from plumbing import heap

if {keep}:
    assert heap.keep_big_buffers()
small = [bytes(100) * 10 for _ in range(10_000)]
def call():
    request, copy, response = b"x" * 2**20, b"y" * 2**20, b"z" * 2**20
    del request, copy, response

call()  # the first one maps their pages
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({CALLS}):
    call()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return int(run.stdout) / (3 * CALLS)


def test_a_big_buffer_freed_and_allocated_again_reuses_its_pages_only_with_the_thresholds_kept():
    assert faults_per_megabyte_buffer(keep=True) < 2
    assert faults_per_megabyte_buffer(keep=False) > 200  # glibc's default maps each one afresh


def tree_faults(front_pid: int) -> int:
    """Minor and major page faults taken so far by the runtime's processes (/proc/PID/stat)."""
    total = 0
    for process in tree(front_pid):
        try:
            with open(f"/proc/{process.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[7]) + int(fields[9])
    return total


def echo_request(values: int) -> v2.ModelInferRequest:
    request = v2.ModelInferRequest(model_name="echo")
    request.inputs.add(name="x", datatype="FP32", shape=[1, values])
    request.raw_input_contents.append(np.ones(values, dtype=np.float32).tobytes())
    return request


# What the front's heap keeps after big calls stop, however many there were: grpc's and the
# front's own allocations made during them, and the pages they share with free chunks, vary from
# run to run (docs/benchmarks.md, "Big tensors"); the 1 MiB buffers themselves come back.
FRONT_KEEPS = 4 * MiB
WORKER_KEEPS = 2 * MiB


def test_a_1_mib_call_after_small_ones_barely_faults_and_the_heap_it_used_comes_back():
    # A short silence limit makes an idle worker wake, and so trim, every 1.5 s.
    with Runtime(WORKER_HEARTBEAT_TIMEOUT_MS="3000") as runtime:
        runtime.load("echo", runtime.model_dir("echo"))
        worker = runtime.worker_for("echo")
        assert worker is not None
        small, big = echo_request(4), echo_request(MiB // 4)
        for _ in range(50):
            runtime.infer.ModelInfer(small, metadata=mesh_headers("echo"), timeout=30)
        front_before, worker_before = uss(runtime.pid), uss(worker.pid)
        for _ in range(3):  # the first ones grow the heaps
            runtime.infer.ModelInfer(big, metadata=mesh_headers("echo"), timeout=30)
        faults_before = tree_faults(runtime.pid)
        for _ in range(20):
            answer = runtime.infer.ModelInfer(big, metadata=mesh_headers("echo"), timeout=30)
            assert answer.raw_output_contents[0] == big.raw_input_contents[0]
        per_call = (tree_faults(runtime.pid) - faults_before) / 20
        assert per_call < 50, f"{per_call:.0f} page faults per 1 MiB call"  # 256 per fresh 1 MiB buffer

        def heaps_given_back() -> bool:
            return (
                uss(runtime.pid) < front_before + FRONT_KEEPS
                and uss(worker.pid) < worker_before + WORKER_KEEPS
            )

        for calls in (20, 40):  # what stays does not grow with the calls
            for _ in range(calls - 20):
                runtime.infer.ModelInfer(big, metadata=mesh_headers("echo"), timeout=30)
            try:
                wait_until(heaps_given_back, timeout=15, interval=0.2, what="the front and worker to trim")
            except AssertionError as error:
                front, kept = (uss(runtime.pid) - front_before) / MiB, (uss(worker.pid) - worker_before) / MiB
                raise AssertionError(
                    f"{error} after {calls} calls: front +{front:.1f} MiB, worker +{kept:.1f} MiB"
                ) from None


# Fills one output buffer of its own on every call: the next call writes it again.
REUSING_MODEL = """
    import numpy as np

    class Model:
        def __init__(self, path):
            self.out = np.zeros(2 * 1024 * 1024, dtype=np.uint8)

        def predict(self, inputs):
            self.out.fill(int(inputs["x"][0]))
            return {"y": self.out}
"""


def test_a_model_that_writes_its_output_buffer_again_never_sends_one_calls_bytes_to_another():
    import concurrent.futures

    with Runtime(SHARED_RING_BYTES="0") as rt:  # every frame through the socket
        rt.load("reuser", rt.model_dir("reuser", REUSING_MODEL))

        def values_back(value: int) -> set[int]:
            request = v2.ModelInferRequest(model_name="reuser")
            request.inputs.add(name="x", datatype="UINT8", shape=[1])
            request.raw_input_contents.append(bytes([value]))
            reply = rt.infer.ModelInfer(request, metadata=mesh_headers("reuser"), timeout=30)
            return set(np.unique(np.frombuffer(reply.raw_output_contents[0], np.uint8)).tolist())

        values = [i % 200 + 1 for i in range(160)]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(values_back, values))
        assert [value for value, back in zip(values, answers, strict=True) if back != {value}] == []
