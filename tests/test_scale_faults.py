"""Faults among many models: a tenth of the workers SIGKILLed at random while calls flow.

Every call must answer within its deadline with OK, UNAVAILABLE (its worker
died under it) or NOT_FOUND; every model must heal and answer again; and the
sizes reported afterwards must still add up to what the pod grew by, measured
from outside (meshtest/cgroup.py; the PSS sum where no cgroup can be made).
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
from harness import ECHO_MODEL, MiB, Runtime, alive, wait_until

from protos import grpc_predict_v2_pb2 as v2
from protos import model_runtime_pb2 as mm

MODELS = 40
KILLED = MODELS // 10
CALLERS = 4
DEADLINE_S = 10.0
ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND}


def call(rt: Runtime, model_id: str) -> tuple[grpc.StatusCode, float]:
    request = v2.ModelInferRequest(model_name=model_id)
    request.inputs.add(name="x", datatype="FP32", shape=[1]).contents.fp32_contents.append(1.0)
    started = time.monotonic()
    try:
        rt.infer.ModelInfer(request, timeout=DEADLINE_S)
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
    return code, time.monotonic() - started


def settle(rt: Runtime) -> None:
    def settled() -> bool:
        return len(alive(rt.spares())) == 1 and rt.model_workers() == MODELS

    wait_until(settled, timeout=60, interval=0.1, what=f"{MODELS} model workers and a spare")


@pytest.mark.slow  # loads 40 models and heals four of them under traffic
def test_killing_a_tenth_of_the_workers_under_traffic_answers_every_call_and_heals_all(meter):
    ids = [f"m{i}" for i in range(MODELS)]
    with Runtime(command_prefix=meter.command_prefix(), LOG_LEVEL="warning") as rt:
        meter.root_pid = rt.pid
        wait_until(lambda: len(alive(rt.spares())) == 1, timeout=30, what="the spare")
        base = meter.settled_usage()
        for model_id in ids:
            rt.load(model_id, rt.model_dir(model_id, ECHO_MODEL))
        victims = {model_id: rt.worker_for(model_id) for model_id in random.sample(ids, KILLED)}

        outcomes: list[tuple[str, grpc.StatusCode, float]] = []
        stop = threading.Event()

        def traffic() -> None:
            while not stop.is_set():
                model_id = random.choice(ids)
                outcomes.append((model_id, *call(rt, model_id)))

        callers = [threading.Thread(target=traffic) for _ in range(CALLERS)]
        for caller in callers:
            caller.start()
        time.sleep(0.5)
        for worker in victims.values():
            worker.kill()
        for model_id, killed in victims.items():
            wait_until(
                lambda m=model_id, k=killed: (w := rt.worker_for(m)) is not None and w.pid != k.pid,
                timeout=30,
                what=f"a new worker for {model_id}",
            )
        time.sleep(0.5)
        stop.set()
        for caller in callers:
            caller.join(DEADLINE_S + 5)

        unexpected = [o for o in outcomes if o[1] not in ANSWERS]
        assert not unexpected, unexpected[:5]
        slowest = max(seconds for _, _, seconds in outcomes)
        assert slowest < DEADLINE_S + 1, f"a call hung for {slowest:.1f} s"
        assert len(outcomes) > 100, "too little traffic to have met the kills"
        # Every model, the healed ones too, answers again.
        assert all(call(rt, model_id)[0] is grpc.StatusCode.OK for model_id in ids)

        settle(rt)
        growth = meter.settled_usage() - base
        sizes = sum(rt.mesh.modelSize(mm.ModelSizeRequest(modelId=m), timeout=30).sizeInBytes for m in ids)
    high = 1.15 if meter.path is not None else 1.35
    ratio = sizes / growth
    shown = f"sizes {sizes / MiB:.1f} MiB, growth {growth / MiB:.1f} MiB ({meter.method})"
    assert 1.00 <= ratio <= high, f"reported / measured {ratio:.3f} after healing: {shown}"
