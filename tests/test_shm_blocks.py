"""Shared-memory blocks a model makes and never unlinks go with the model (plumbing/shmblocks.py)."""

from __future__ import annotations

import json
import os

import pytest
from harness import Runtime, alive, wait_until

from plumbing import shmblocks

MiB = 1024 * 1024

# Makes a block of BLOCK_MIB in its constructor and never unlinks it; answers with its name and a byte
# of it, written in the constructor. With the file "tidy" in its folder, close() unlinks it itself.
BLOCK_MODEL = """
    import os
    import numpy as np
    from multiprocessing import shared_memory

    class Model:
        def __init__(self, path):
            self.block = shared_memory.SharedMemory(create=True, size={mib} * 1024 * 1024)
            self.block.buf[:] = bytes([7]) * len(self.block.buf)
            self.tidy = os.path.exists(os.path.join(path, "tidy"))

        def predict(self, inputs):
            return {{"name": np.array([self.block.name], dtype=object),
                    "byte": np.array([self.block.buf[-1]], dtype=np.int64)}}

        def close(self):
            if self.tidy:
                self.block.close()
                self.block.unlink()
"""


def block_model(rt: Runtime, name: str, mib: int = 4, tidy: bool = False) -> str:
    folder = rt.model_dir(name, BLOCK_MODEL.format(mib=mib))
    if tidy:
        open(os.path.join(folder, "tidy"), "w").close()
    return folder


def block_of(rt: Runtime, model_id: str) -> str:
    """The /dev/shm file of the model's block, read back through a call (which also checks its data)."""
    outputs = {o.name: o for o in rt.infer_fp32(model_id, [1.0]).outputs}
    assert list(outputs["byte"].contents.int64_contents) == [7]
    return os.path.join("/dev/shm", outputs["name"].contents.bytes_contents[0].decode())


def test_the_unload_of_a_model_in_a_worker_of_its_own_unlinks_the_block_it_left():
    with Runtime() as rt:
        rt.load("m", block_model(rt, "m"))
        block = block_of(rt, "m")
        assert os.path.exists(block)
        rt.unload("m")
        assert not os.path.exists(block)
        assert f"unlinked shared-memory block /{os.path.basename(block)} (4.0 MiB)" in rt.log()


def test_a_pack_unlinks_a_dropped_models_block_and_keeps_its_neighbours():
    with Runtime(MODELS_PER_WORKER="4", MODEL_PACK_MAX_BYTES=str(64 * MiB)) as rt:
        for model_id in ("a", "b"):
            rt.load(model_id, block_model(rt, model_id))
        assert rt.worker_for("a") == rt.worker_for("b")
        pack = rt.worker_for("a")
        a, b = block_of(rt, "a"), block_of(rt, "b")
        rt.unload("a")
        assert not os.path.exists(a) and os.path.exists(b)
        assert rt.worker_for("b") == pack  # the pack shrank by what a was charged: no recycle
        assert f"unlinked shared-memory block /{os.path.basename(a)} (4.0 MiB) that a left" in rt.log()
        assert block_of(rt, "b") == b
        rt.unload("b")
        assert not os.path.exists(b)


def test_a_model_that_unlinks_its_own_block_leaves_nothing_to_unlink():
    with Runtime() as rt:
        rt.load("m", block_model(rt, "m", tidy=True))
        block = block_of(rt, "m")
        rt.unload("m")
        assert not os.path.exists(block)
        assert "unlinked shared-memory block" not in rt.log()


def test_a_crashed_workers_block_is_unlinked_when_it_is_reaped():
    with Runtime() as rt:
        rt.load("m", block_model(rt, "m"))
        block, worker = block_of(rt, "m"), rt.worker_for("m")
        worker.kill()
        wait_until(lambda: not os.path.exists(block), timeout=10, what="the dead worker's block to go")
        assert block_of(rt, "m") != block  # healed, with a block of its own


def test_a_new_front_unlinks_the_blocks_an_earlier_ones_workers_left():
    first = Runtime().start()
    try:
        first.load("m", block_model(first, "m"))
        block, worker = block_of(first, "m"), first.worker_for("m")
        first.process.kill()  # its workers die with it, unreaped by it
        first.process.wait()
        wait_until(lambda: not alive([worker]), timeout=10, what="the worker to die")
        assert os.path.exists(block)
        second = Runtime(RUNTIME_DIR=first.env["RUNTIME_DIR"]).start()
        try:
            assert not os.path.exists(block)
            assert "that the models of an earlier front's worker pid" in second.log()
        finally:
            second.stop()
    finally:
        first.stop()


@pytest.fixture
def scratch_block():
    path = os.path.join("/dev/shm", f"mesh-test-{os.getpid()}")
    with open(path, "wb") as block:
        block.write(b"x" * 8192)
    yield path
    if os.path.exists(path):
        os.unlink(path)


def write_record(path: str, *lines: list) -> None:
    with open(path, "w") as record:
        record.writelines(json.dumps(line) + "\n" for line in lines)
        record.write('["+", "/cut-sho')  # a line cut short by a kill


def test_a_record_unlinks_only_the_registered_file_still_there(tmp_path, scratch_block):
    name, inode = "/" + os.path.basename(scratch_block), os.stat(scratch_block).st_ino
    record = str(tmp_path / "1")
    write_record(record, ["+", name, inode + 1])  # another file of the same name, gone since
    assert shmblocks.unlink_recorded(record) == []
    assert os.path.exists(scratch_block) and not os.path.exists(record)
    write_record(record, ["+", name, inode], ["-", name, inode])  # unlinked by its model
    assert shmblocks.unlink_recorded(record) == [] and os.path.exists(scratch_block)
    write_record(record, ["+", "/../tmp", 1], ["+", name, inode])
    assert shmblocks.unlink_recorded(record) == [(name, 8192)]
    assert not os.path.exists(scratch_block)


def test_names_outside_dev_shm_name_no_block():
    assert shmblocks.block_path("/psm_1a2b") == "/dev/shm/psm_1a2b"
    for name in ("/", "", "/..", "/.", "a/b", "/../etc/passwd"):
        assert shmblocks.block_path(name) is None
