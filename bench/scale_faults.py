"""The faults phase of scripts/bench --scale: a tenth of the workers SIGKILLed while calls flow.

Once FAULTS_AT models are loaded (or at the last step, if fewer are asked
for), CALLERS threads call random models, each call with a DEADLINE_S
deadline, while a tenth of the model workers are SIGKILLed at once. Every
call must answer OK, UNAVAILABLE (its worker died under it) or NOT_FOUND
(its model was healing) before its deadline; every killed model must get a
new worker and answer again; and the sizes modelSize reports once it has
healed must still add up to what the cgroup grew by. The same checks at 40
models are a test (tests/test_scale_faults.py); this is the full figure.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import threading
import time

import grpc

from bench.common import progress
from bench.scale_servers import MeshRuntime
from meshtest import cgroup, harness

FAULTS_AT = 500
KILLED_SHARE = 0.10
CALLERS = 4
DEADLINE_S = 10.0
HEAL_TIMEOUT_S = 120.0
ANSWERS = {grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND}


def run_faults(server: MeshRuntime, meter: cgroup.Meter, base: int, loaded: int, held: int) -> dict:
    """Kills a tenth of the model workers (or packs) under traffic; what every call answered, and
    the healing."""
    pids = server.worker_pids()
    workers = sorted(set(pids.values()))
    killed_pids = set(random.sample(workers, max(1, round(len(workers) * KILLED_SHARE))))
    victims = {index: pid for index, pid in pids.items() if pid in killed_pids}
    progress(
        f"{server.name}: SIGKILL {len(killed_pids)} of {len(workers)} model workers "
        f"({len(victims)} of {loaded} models) under traffic"
    )
    outcomes: list[tuple[grpc.StatusCode, float]] = []
    stop = threading.Event()

    def traffic() -> None:
        while not stop.is_set():
            started = time.monotonic()
            code = server.try_infer(random.randrange(loaded), DEADLINE_S)
            outcomes.append((code, time.monotonic() - started))

    callers = [threading.Thread(target=traffic) for _ in range(CALLERS)]
    for caller in callers:
        caller.start()
    try:
        time.sleep(1.0)
        killed_at = time.monotonic()
        for pid in killed_pids:
            kill(pid)
        heal_s = wait_healed(server, victims, killed_at)
        time.sleep(1.0)
    finally:
        stop.set()
        for caller in callers:
            caller.join(DEADLINE_S + 5)
    answering_again = sum(server.try_infer(index, DEADLINE_S) is grpc.StatusCode.OK for index in victims)
    server.wait_settled()
    growth = meter.settled_usage() - base
    reported = server.reported_now()
    codes = collections.Counter(code.name for code, _ in outcomes)
    slowest = max((seconds for _, seconds in outcomes), default=0.0)
    return {
        "models": loaded,
        "killed": len(killed_pids),
        "models_killed": len(victims),
        "calls": len(outcomes),
        "codes": dict(codes),
        "unexpected_calls": sum(code not in ANSWERS for code, _ in outcomes),
        "slowest_call_s": slowest,
        "deadline_s": DEADLINE_S,
        "heal_s": heal_s,
        "answering_again": answering_again,
        "reported_over_growth": reported / growth if growth > 0 else None,
        "with_held_back_over_growth": (reported + held) / growth if growth > 0 else None,
    }


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:  # it died by itself: it still has to heal
        pass


def wait_healed(server: MeshRuntime, killed: dict[int, int], since: float) -> float:
    """Seconds from `since` until every killed model runs in a worker with a new pid."""

    def healed() -> bool:
        now = server.worker_pids()
        return all(now.get(index) not in (None, pid) for index, pid in killed.items())

    harness.wait_until(healed, timeout=HEAL_TIMEOUT_S, interval=0.2, what="every killed model healed")
    return time.monotonic() - since


def describe(faults: dict) -> str:
    """One line for the report."""
    codes = ", ".join(f"{name} {count}" for name, count in sorted(faults["codes"].items()))
    ratio, held = faults["reported_over_growth"], faults["with_held_back_over_growth"]
    return (
        f"faults at N={faults['models']}: {faults['killed']} workers ({faults['models_killed']} models) "
        f"SIGKILLed under {CALLERS} callers; "
        f"{faults['calls']} calls ({codes}), {faults['unexpected_calls']} other; "
        f"slowest {faults['slowest_call_s']:.2f} s (deadline {faults['deadline_s']:.0f} s); "
        f"all {faults['models_killed']} healed in {faults['heal_s']:.1f} s, "
        f"{faults['answering_again']} answering again; "
        f"reported / growth after healing {'-' if ratio is None else f'{ratio:.2f}'}"
        f" ({'-' if held is None else f'{held:.2f}'} with what capacity holds back for open packs)"
    )
