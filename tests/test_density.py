"""Many models in one runtime: the sizes it reports add up to what the pod is charged.

Measured from outside: the memory cgroup the runtime runs in (meshtest/cgroup.py)
where one can be created, as root; else the PSS sum of its process tree, which
misses the kernel's share (page tables, stacks) that the reported sizes count,
so the upper bound is looser there.
"""

from __future__ import annotations

import pytest
from harness import ECHO_MODEL, MiB, Runtime, alive, wait_until

from meshtest import cgroup
from protos import model_runtime_pb2 as mm

MODELS = 100
WARM = 1
CONTAINER = 8 * 1024 * MiB
BUFFER = 128 * MiB


def settle(rt: Runtime, model_workers: int) -> None:
    def settled() -> bool:
        return len(alive(rt.spares())) == WARM and rt.model_workers() == model_workers

    wait_until(settled, timeout=60, interval=0.1, what=f"{model_workers} model workers and {WARM} spare")


def capacity(rt: Runtime) -> int:
    return rt.mesh.runtimeStatus(mm.RuntimeStatusRequest(), timeout=30).capacityInBytes


def unmapped_cache(meter: cgroup.Meter) -> int:
    """Page cache the cgroup is charged for that no process maps (files read, logs written), v1 only."""
    if meter.path is None or not meter.usage_file.endswith("usage_in_bytes"):
        return 0
    with open(f"{meter.path}/memory.stat") as stat_file:
        stat = dict((line.split()[0], int(line.split()[1])) for line in stat_file)
    return stat["cache"] - stat["mapped_file"]


@pytest.mark.slow  # loads 100 models
def test_sizes_of_100_python_models_cover_what_the_pod_grew_by_and_not_much_more(meter):
    rt = Runtime(
        command_prefix=meter.command_prefix(),
        WORKERS_WARM=str(WARM),
        CONTAINER_MEM_REQ_BYTES=str(CONTAINER),
        MEM_BUFFER_BYTES=str(BUFFER),
        LOG_LEVEL="warning",
    )
    with rt:
        meter.root_pid = rt.pid
        settle(rt, 0)
        base = meter.settled_usage()
        capacity_before = capacity(rt)
        sizes = []
        for i in range(MODELS):
            sizes.append(rt.load(f"m{i}", rt.model_dir(f"m{i}", ECHO_MODEL)).sizeInBytes)
            rt.infer_fp32(f"m{i}", [[1.0, 2.0]])  # its first call, as traffic would make it
        settle(rt, MODELS)
        usage = meter.settled_usage()
        ratio = sum(sizes) / (usage - base)
        capacity_after = capacity(rt)
        overhead = CONTAINER - BUFFER - capacity_after
    high = 1.15 if meter.path is not None else 1.35
    shown = f"sizes {sum(sizes) / MiB:.1f} MiB, growth {(usage - base) / MiB:.1f} MiB ({meter.method})"
    assert 1.00 <= ratio <= high, f"reported / measured {ratio:.3f}: {shown}"
    # Capacity leaves the models out and counts the rest of the tree as the sizes
    # count a model: together they are what the pod holds (cache nobody maps aside).
    held = usage - unmapped_cache(meter)
    assert 1.00 <= (overhead + sum(sizes)) / held <= high, (overhead, sum(sizes), held)
    # It moves only by what the front itself holds for each worker.
    assert 0 <= capacity_before - capacity_after < 16 * MiB, (capacity_before, capacity_after)
