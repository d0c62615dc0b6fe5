"""What a model's helper processes hold is in the model's size.

A model may start processes (a server it talks to, a multiprocessing pool):
they end with its worker, or with its drop from a pack, so what they hold is
the model's. model-mesh packs the pod by the sizes we report and reads the
capacity once, so memory in no size would go unaccounted for good. Measured
from outside (runtime/memory.py tree_cost, cost_or_zero): a subprocess's
pages are its own, a forked one's are shared with its parent until one of
them writes to them, and shared memory two of them map is both's: such
pages are in neither one's unique pages.
"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest
from harness import MiB, Runtime, tree

from plumbing import lifeline
from protos import model_runtime_pb2 as mm
from runtime import memory

HELD_MIB = 64

# Holds HELD_MIB of written pages, says so in a file, and waits.
_HOLDER = (
    "import sys, time; held = bytes([1]) * ({mib} << 20); open(sys.argv[1], 'w').close(); time.sleep(600)"
)

# A model whose constructor starts a helper that holds HELD_MIB, and waits until it does.
HELPER_MODEL = f"""
    import os, subprocess, sys, time

    class Model:
        def __init__(self, path):
            ready = os.path.join(path, "helper-ready")
            if os.path.exists(ready):
                os.unlink(ready)
            code = {_HOLDER.format(mib=HELD_MIB)!r}
            self.helper = subprocess.Popen([sys.executable, "-c", code, ready])
            while not os.path.exists(ready):
                time.sleep(0.01)

        def predict(self, inputs):
            return dict(inputs)
"""

# A model that writes HELD_MIB, then forks a child that sleeps: what it wrote is then the two's.
FORKING_MODEL = f"""
    import os, time
    import numpy as np

    class Model:
        def __init__(self, path):
            self.held = np.ones({HELD_MIB} << 20, dtype=np.uint8)
            if os.fork() == 0:
                time.sleep(600)
                os._exit(0)

        def predict(self, inputs):
            return dict(inputs)
"""

# A parent holding HELD_MIB of written pages forks a child that only sleeps: the pages
# are then shared by the two, in neither one's unique memory.
_FORKING_PARENT = f"""
import os, sys, time
held = bytes([1]) * ({HELD_MIB} << 20)
if os.fork() == 0:
    time.sleep(600)
    os._exit(0)
open(sys.argv[1], "w").close()
time.sleep(600)
"""


def _started(code: str, tmp_path, *args: str) -> subprocess.Popen:
    ready = tmp_path / "ready"
    process = subprocess.Popen([sys.executable, "-c", code, str(ready), *args])
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and process.poll() is None, "the process did not get ready"
        time.sleep(0.01)
    return process


def _end_tree(process: subprocess.Popen) -> None:
    lifeline.kill_descendants(process.pid)
    process.kill()
    process.wait()


@pytest.fixture
def parent_of_a_holder(tmp_path):
    """A process (a stand-in for a worker) whose subprocess holds HELD_MIB."""
    code = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {_HOLDER.format(mib=HELD_MIB)!r}, sys.argv[1]]); "
        "time.sleep(600)"
    )
    process = _started(code, tmp_path)
    yield process
    _end_tree(process)


# A parent writes HELD_MIB of shared memory (a memfd) and runs a program that maps all of it:
# the pages are then the two's, in neither one's unique memory. Both gone, the memfd is freed.
_SHARING_PARENT = f"""
import mmap, os, subprocess, sys, time
size = {HELD_MIB} << 20
fd = os.memfd_create("held")
os.ftruncate(fd, size)
shared = mmap.mmap(fd, size)
shared[:] = bytes([1]) * size
reader = (
    "import mmap, sys, time; size = int(sys.argv[2]); m = mmap.mmap(int(sys.argv[1]), size); "
    "sum(m[i] for i in range(0, size, 4096)); open(sys.argv[3], 'w').close(); time.sleep(600)"
)
subprocess.Popen([sys.executable, "-c", reader, str(fd), str(size), sys.argv[1]], pass_fds=[fd])
time.sleep(600)
"""


@pytest.fixture
def sharing_parent(tmp_path):
    process = _started(_SHARING_PARENT, tmp_path)
    yield process
    _end_tree(process)


@pytest.fixture
def forking_parent(tmp_path):
    process = _started(_FORKING_PARENT, tmp_path)
    yield process
    _end_tree(process)


def test_a_workers_cost_holds_what_its_subprocess_holds(parent_of_a_holder):
    assert memory.cost(parent_of_a_holder.pid) < HELD_MIB * MiB // 2
    assert memory.cost_or_zero(parent_of_a_holder.pid) >= HELD_MIB * MiB


def test_a_workers_cost_holds_the_pages_it_shares_with_a_child_it_forked(forking_parent):
    # Each one's unique pages miss the pages they share: a sum of cost() would too.
    (child,) = lifeline.descendants(forking_parent.pid)
    assert memory.cost(forking_parent.pid) + memory.cost(child) < HELD_MIB * MiB // 2
    assert memory.tree_cost(forking_parent.pid) >= HELD_MIB * MiB


def test_a_workers_cost_holds_the_shared_memory_it_maps_with_a_program_it_ran(sharing_parent):
    (child,) = lifeline.descendants(sharing_parent.pid)
    assert memory.cost(sharing_parent.pid) + memory.cost(child) < HELD_MIB * MiB // 2
    assert memory.tree_cost(sharing_parent.pid) >= HELD_MIB * MiB


def test_a_process_with_nothing_below_it_costs_what_it_did():
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.3)  # its exec done: its pages no longer change between two readings
        assert memory.cost_or_zero(sleeper.pid) == memory.cost(sleeper.pid)
        assert memory.tree_cost(sleeper.pid) == memory.cost(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_overhead_leaves_out_what_runs_below_a_model_worker(parent_of_a_holder):
    # The helper is in the model's size: counted in the overhead too, capacity would pay twice.
    with_it = memory.overhead(set())
    without = memory.overhead({parent_of_a_holder.pid})
    assert with_it - without >= HELD_MIB * MiB


# A pack limit that the helpers' memory stays under: what moves them out of a pack is their processes.
HELPERS_FIT = {"MODELS_PER_WORKER": "8", "MODEL_PACK_MAX_BYTES": str(256 * MiB)}
SETTINGS = {
    "own-worker": {"MODELS_PER_WORKER": "1"},
    # Measured as a tree of its own, in a worker of its own: a pack's measures miss what a model
    # shares with its processes (shared memory, pages a forked child has not written yet).
    "leaves-its-pack": {"MODELS_PER_WORKER": "8"},
    "leaves-its-pack-however-small": HELPERS_FIT,
}


@pytest.mark.parametrize("model", [HELPER_MODEL, FORKING_MODEL], ids=["subprocess", "forked"])
@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_a_models_size_holds_what_its_helper_holds(settings, model):
    with Runtime(**settings) as rt:
        rt.load("warm-up", rt.model_dir("warm-up"))
        size = rt.load("helper", rt.model_dir("helper", model)).sizeInBytes
        assert not any("models=2" in " ".join(pack.cmdline()) for pack in rt.packs())
        if settings is HELPERS_FIT:
            assert "helper left processes running below its pack: it moves to a worker of its own" in rt.log()
        assert size >= HELD_MIB * MiB, f"reported {size / MiB:.1f} MiB"
        reported = rt.mesh.modelSize(mm.ModelSizeRequest(modelId="helper"), timeout=30).sizeInBytes
        assert reported >= HELD_MIB * MiB
        # Each reading with the spares in place: one forked between them would hide part of the drop.
        rt.settled_uss()
        before = _tree_pss(rt.pid)
        rt.unload("helper")
        rt.settled_uss()
        assert before - _tree_pss(rt.pid) >= HELD_MIB * MiB  # its helper ended with it


def _tree_pss(pid: int) -> int:
    """The PSS of a process tree: pages its processes share among them count once (USS would miss
    what a forked child shares with its parent)."""
    total = 0
    for process in tree(pid):
        try:
            total += memory.proportional(process.pid)
        except psutil.Error:
            pass  # gone meanwhile, or a zombie
    return total


# Keeps 8 MiB after its drop (in numpy's module), so that its unload recycles its pack.
KEEPING_MODEL = """
    import numpy as np

    class Model:
        def __init__(self, path):
            np._kept_by_test = getattr(np, "_kept_by_test", []) + [np.ones(8 << 20, dtype=np.uint8)]

        def predict(self, inputs):
            return dict(inputs)
"""


def test_models_that_start_processes_leave_their_neighbours_charges_alone():
    # Charged in the pack for what it shares with its child, counted among the growth the pack's
    # unique pages hold, a forking model made a later helper's load and a recycled pack's base come
    # out short; both move to workers of their own now, and leave nothing behind in the pack.
    with Runtime(**HELPERS_FIT) as rt:
        rt.load("warm-up", rt.model_dir("warm-up"))
        assert rt.load("forker", rt.model_dir("forker", FORKING_MODEL)).sizeInBytes >= HELD_MIB * MiB
        assert rt.load("helper", rt.model_dir("helper", HELPER_MODEL)).sizeInBytes >= HELD_MIB * MiB
        rt.load("keeping", rt.model_dir("keeping", KEEPING_MODEL))
        rt.unload("keeping")
        assert "recycling" in rt.log()
        for model_id in ("after", "after-too"):
            size = rt.load(model_id, rt.model_dir(model_id)).sizeInBytes
            assert 256 * 1024 < size < 4 * MiB, f"{model_id}: {size}"


# Writes BIG_MIB of its own: its unload gives them back.
BIG_MODEL = """
    import numpy as np

    class Model:
        def __init__(self, path):
            self.held = np.ones(16 << 20, dtype=np.uint8)

        def predict(self, inputs):
            return dict(inputs)
"""

# Forks a child that sleeps, and writes nothing of its own.
FORKER_MODEL = """
    import os, time

    class Model:
        def __init__(self, path):
            if os.fork() == 0:
                time.sleep(600)
                os._exit(0)

        def predict(self, inputs):
            return dict(inputs)
"""


def test_a_child_forked_in_a_pack_does_not_keep_its_neighbours_pages_after_their_unload():
    # Forked in the pack, the child held a copy of every page of the models loaded before it: their
    # unload gave back nothing of those, and the next load into the pack was charged them.
    with Runtime(**HELPERS_FIT) as rt:
        rt.load("warm-up", rt.model_dir("warm-up"))
        rt.load("big", rt.model_dir("big", BIG_MODEL))
        rt.load("forker", rt.model_dir("forker", FORKER_MODEL))
        assert "forker left processes running below its pack" in rt.log()
        packs = rt.packs()  # warm-up's and big's (a child forked there has its title too)
        (pack,) = [p for p in packs if p.ppid() not in {other.pid for other in packs}]
        before = _tree_pss(pack.pid)
        rt.unload("big")
        assert before - _tree_pss(pack.pid) >= 15 * MiB
        size = rt.load("after", rt.model_dir("after")).sizeInBytes
        assert size < 4 * MiB, f"{size / MiB:.1f} MiB"
