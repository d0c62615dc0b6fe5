"""runtime/spawning.py: each fork server starts its workers on a thread of its own, so one that
hangs (or imports for long) holds up neither another fork server's workers nor any reap."""

import contextlib
import os
import time

import psutil
from harness import REPO, Runtime, wait_until

from protos import model_runtime_pb2 as mm

HUNG = "onnxruntime"  # the cheapest framework to import: a second fork server beside the base one


def title(process: psutil.Process) -> str:
    return " ".join(process.cmdline())


@contextlib.contextmanager
def hung_fork_server(tmp_path, **env: str):
    """A runtime whose onnxruntime fork server was killed and started again, and hangs importing
    what it preloads, while the front starts a spare of it."""
    marker = tmp_path / "hang"
    rt = Runtime(
        WORKER_PRELOAD=f"numpy,{HUNG},hangs_at_import",
        PYTHONPATH=os.path.join(REPO, "meshtest"),
        MESH_TEST_HANG_GROUP=HUNG,
        MESH_TEST_HANG_MARKER=str(marker),
        **env,
    )
    rt.start()
    try:
        (first,) = [p for p in rt.forkservers() if f"forkserver {HUNG} " in title(p)]
        marker.touch()
        first.kill()  # the OOM killer, say; its spare dies with it, and the front starts another
        wait_until(
            lambda: any(f"forkserver {HUNG} " in title(p) for p in rt.forkservers() if p.pid != first.pid),
            timeout=10,
            what="the fork server started again",
        )
        time.sleep(0.5)  # the start of its spare waits for its import
        (hung,) = [p for p in rt.forkservers() if f"forkserver {HUNG} " in title(p)]
        assert not hung.children(), "the fork server forked: it does not hang"
        yield rt
    finally:
        with contextlib.suppress(FileNotFoundError):
            marker.unlink()
        rt.stop()


def test_python_loads_are_served_while_another_fork_server_hangs_importing(tmp_path):
    with hung_fork_server(tmp_path, WORKERS_WARM="1", LOADTIME_TIMEOUT="10000") as rt:
        for name in ("p0", "p1", "p2"):  # the spare there, then two forked while the other hangs
            started = time.monotonic()
            rt.load(name, rt.model_dir(name), timeout=30)
            assert time.monotonic() - started < 10
            assert list(rt.infer_fp32(name, [1.5]).outputs[0].contents.fp32_contents) == [1.5]


def test_an_unload_is_answered_while_another_fork_server_hangs_importing(tmp_path):
    with hung_fork_server(tmp_path, WORKERS_WARM="1") as rt:
        rt.load("a", rt.model_dir("a"))
        started = time.monotonic()
        rt.mesh.unloadModel(mm.UnloadModelRequest(modelId="a"), timeout=10)  # answered once reaped
        assert time.monotonic() - started < 5, rt.log()[-2000:]
