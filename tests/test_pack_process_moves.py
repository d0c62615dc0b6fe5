"""Which packed models leave their pack for their processes, and what they leave behind.

A packed model whose load leaves processes running moves to a worker of its
own (runtime/supervisor.py), as the pack tells which (workers/holding.py):
the processes its loading thread started, and multiprocessing's servers its
load (or its pack's rehearsal of it) started. Not processes its neighbours'
threads start meanwhile, nor one that already exited.
"""

from __future__ import annotations

import os
import signal
import time

import grpc
import psutil
import pytest
from harness import MiB, Runtime, wait_until

# Packs of 4 under a limit that none of these models' memory reaches: their processes alone decide.
PACKS_OF_4 = {"MODELS_PER_WORKER": "4", "MODEL_PACK_MAX_BYTES": str(256 * MiB)}

# Its thread starts a process every 50 ms for as long as it is loaded: any load beside it meets one.
POLLER_MODEL = """
    import subprocess, threading, time

    def _poll():
        while True:
            subprocess.Popen(["sleep", "1"])
            time.sleep(0.05)

    class Model:
        def __init__(self, path):
            threading.Thread(target=_poll, daemon=True).start()

        def predict(self, inputs):
            return dict(inputs)
"""

# Takes a while to load, and starts nothing.
SLOW_MODEL = """
    import time

    class Model:
        def __init__(self, path):
            time.sleep(0.3)

        def predict(self, inputs):
            return dict(inputs)
"""

# Runs a program that is done at once, and keeps it unreaped: a zombie, which holds no memory.
ZOMBIE_MODEL = """
    import subprocess, time

    class Model:
        def __init__(self, path):
            self.done = subprocess.Popen(["true"])
            time.sleep(0.2)

        def predict(self, inputs):
            return dict(inputs)
"""

# Starts a helper with multiprocessing's forkserver context (which starts that fork server), notes its
# pid in a line per load, and ends it on close(), taking up to `close_s` for it.
FORKSERVER_MODEL = """
    import multiprocessing, os, time

    class Model:
        def __init__(self, path):
            self.helper = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(600,))
            self.helper.start()
            with open(os.path.join(path, "helper.pid"), "a") as f:
                f.write(f"{{self.helper.pid}}\\n")
            time.sleep({load_s})

        def predict(self, inputs):
            return dict(inputs)

        def close(self):
            self.helper.join({close_s})
            self.helper.kill()
"""


def _moved_out(rt: Runtime, model_id: str) -> bool:
    return f"{model_id} left processes running below its pack" in rt.log()


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_model_stays_packed_whatever_processes_its_neighbours_threads_start_during_its_load():
    with Runtime(**PACKS_OF_4) as rt:
        rt.load("poller", rt.model_dir("poller", POLLER_MODEL))
        for index in range(3):
            rt.load(f"slow-{index}", rt.model_dir(f"slow-{index}", SLOW_MODEL))
            assert rt.infer_fp32(f"slow-{index}", [1.0]).outputs
        assert not any(_moved_out(rt, f"slow-{index}") for index in range(3)), rt.log()
        assert [" ".join(pack.cmdline()).split(" dir=")[0] for pack in rt.packs()] == [
            "mesh-runtime pack models=4"
        ]


def test_a_model_whose_load_leaves_only_an_exited_process_stays_packed():
    with Runtime(**PACKS_OF_4) as rt:
        rt.load("neighbour", rt.model_dir("neighbour"))
        rt.load("zombie", rt.model_dir("zombie", ZOMBIE_MODEL))
        assert not _moved_out(rt, "zombie")
        assert any("models=2" in " ".join(pack.cmdline()) for pack in rt.packs())


@pytest.mark.parametrize("cut_short_by", ["unload", "deadline"])
def test_a_move_cut_short_still_ends_what_the_model_left_in_its_pack(cut_short_by):
    # Its fork server outlives its drop: the pack is recycled, even when the move is cancelled as
    # the drop runs, and unloadModel returns only once it is.
    with Runtime(**PACKS_OF_4) as rt:
        rt.load("neighbour", rt.model_dir("neighbour"))
        folder = rt.model_dir("forking", FORKSERVER_MODEL.format(load_s=0, close_s=1.0))
        if cut_short_by == "deadline":
            with pytest.raises(grpc.RpcError):
                rt.load("forking", folder, timeout=0.4)
        else:
            loading = rt.load_future("forking", folder)
            while not _moved_out(rt, "forking"):
                time.sleep(0.01)
            time.sleep(0.2)  # in the pack's drop of it, which waits for its helper
        rt.unload("forking")
        with open(os.path.join(folder, "helper.pid")) as pids:
            in_the_pack = int(pids.read().split()[0])
        assert _ended(in_the_pack)
        assert not [child for pack in rt.packs() for child in pack.children()]
        assert "processes the load of forking started outlived it" in rt.log()
        assert rt.infer_fp32("neighbour", [1.0]).outputs
        if cut_short_by == "unload":
            with pytest.raises(grpc.RpcError):
                loading.result(timeout=30)


def test_the_fork_server_a_packs_rehearsal_started_is_the_models_too():
    # The first model of a fresh pack loads twice, once to rehearse: the fork server its first load
    # started was running already when the load that counts began, and stayed below the pack.
    with Runtime(**PACKS_OF_4) as rt:
        first = rt.load_future(
            "forking", rt.model_dir("forking", FORKSERVER_MODEL.format(load_s=0.3, close_s=0))
        )
        time.sleep(0.1)
        neighbour = rt.load_future("neighbour", rt.model_dir("neighbour"))  # no spare: into its pack
        first.result(timeout=60)
        neighbour.result(timeout=60)
        assert _moved_out(rt, "forking")
        rt.unload("forking")
        assert not [child for pack in rt.packs() for child in pack.children()]
        assert rt.infer_fp32("neighbour", [1.0]).outputs


def test_a_model_that_left_its_pack_loads_straight_into_a_worker_of_its_own_the_next_time():
    with Runtime(**PACKS_OF_4) as rt:
        folder = rt.model_dir("forking", FORKSERVER_MODEL.format(load_s=0, close_s=0))
        rt.load("forking", folder)
        rt.unload("forking")
        rt.load("forking", folder)
        with open(os.path.join(folder, "helper.pid")) as pids:
            # In a fresh pack, its rehearsal and its load; then one in a worker of its own each time.
            assert len(pids.read().split()) == 4
        assert rt.worker_for("forking") is not None


# Starts a helper only when its folder says so: a load that does what it finds.
SOMETIMES_MODEL = """
    import os, subprocess

    class Model:
        def __init__(self, path):
            if os.path.exists(os.path.join(path, "start-helper")):
                self.helper = subprocess.Popen(["sleep", "600"])

        def predict(self, inputs):
            return dict(inputs)
"""


def test_a_heal_that_leaves_processes_in_a_pack_says_so_and_the_next_load_moves_the_model_out():
    # Its size was reported as it loaded the first time, in a pack: the heal keeps it packed, and
    # tells why its pack may cost more than the sizes say.
    with Runtime(**PACKS_OF_4) as rt:
        rt.load("neighbour", rt.model_dir("neighbour"))
        folder = rt.model_dir("sometimes", SOMETIMES_MODEL)
        rt.load("sometimes", folder)
        open(os.path.join(folder, "start-helper"), "w").close()
        (pack,) = rt.packs()
        os.kill(pack.pid, signal.SIGKILL)
        wait_until(lambda: "healed sometimes" in rt.log(), timeout=30, what="its heal")
        assert "sometimes left processes running below" in rt.log()
        assert "as it reloaded" in rt.log()
        rt.unload("sometimes")
        rt.load("sometimes", folder)
        assert rt.worker_for("sometimes") is not None
