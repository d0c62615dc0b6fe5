"""Shared-memory blocks a model makes and never unlinks go with the model (plumbing/shmblocks.py)."""

from __future__ import annotations

import json
import os

import pytest
from harness import Runtime, alive, tree, wait_until

from plumbing import lifeline, shmblocks

MiB = 1024 * 1024

# Makes a block of 4 MiB in its constructor and never unlinks it, unless the file "tidy" is in its
# folder (then close() does). With the file "attach" holding a name, it attaches to that block
# instead; with "fixed" holding one, it makes a block of that name, or attaches to it if it is
# there (a reload beside the one before). With "fork", a child it forks makes the block. With
# "fail", its load raises after making it. Answers with its block's name and last byte.
BLOCK_MODEL = """
    import os
    import numpy as np
    from multiprocessing import shared_memory

    def setting(path, name):
        file = os.path.join(path, name)
        return open(file).read() if os.path.exists(file) else None

    def made(block):
        block.buf[:] = bytes([7]) * len(block.buf)  # its pages in use, as a model's data would be
        return block

    class Model:
        def __init__(self, path):
            attach, fixed = setting(path, "attach"), setting(path, "fixed")
            if attach:
                self.block = shared_memory.SharedMemory(name=attach)
            elif fixed:
                try:
                    self.block = made(shared_memory.SharedMemory(name=fixed, create=True, size=4 << 20))
                except FileExistsError:
                    self.block = shared_memory.SharedMemory(name=fixed)
            elif setting(path, "fork") is not None:
                reading, writing = os.pipe()
                if os.fork() == 0:
                    block = made(shared_memory.SharedMemory(create=True, size=4 << 20))
                    os.write(writing, block.name.encode())
                    os._exit(0)
                os.close(writing)
                self.block = shared_memory.SharedMemory(name=os.read(reading, 100).decode())
            else:
                self.block = made(shared_memory.SharedMemory(create=True, size=4 << 20))
            self.tidy = setting(path, "tidy") is not None
            if setting(path, "fail") is not None:
                open(os.path.join(path, "made"), "w").write(self.block.name)
                raise RuntimeError("failing on purpose")

        def predict(self, inputs):
            return {"name": np.array([self.block.name], dtype=object),
                    "byte": np.array([self.block.buf[-1]], dtype=np.int64)}

        def close(self):
            if self.tidy:
                self.block.close()
                self.block.unlink()
"""


def block_model(rt: Runtime, name: str, **settings: str) -> str:
    folder = rt.model_dir(name, BLOCK_MODEL)
    for setting, value in settings.items():
        with open(os.path.join(folder, setting), "w") as file:
            file.write(value)
    return folder


def block_of(rt: Runtime, model_id: str) -> str:
    """The /dev/shm file of the model's block, read back through a call (which also checks its data)."""
    outputs = {o.name: o for o in rt.infer_fp32(model_id, [1.0]).outputs}
    assert list(outputs["byte"].contents.int64_contents) == [7]
    return os.path.join("/dev/shm", outputs["name"].contents.bytes_contents[0].decode().lstrip("/"))


@pytest.fixture
def fixed_name():
    name = f"mesh-test-{os.getpid()}"
    yield name
    if os.path.exists(f"/dev/shm/{name}"):
        os.unlink(f"/dev/shm/{name}")


def test_the_unload_of_a_model_in_a_worker_of_its_own_unlinks_the_block_it_left():
    with Runtime() as rt:
        rt.load("m", block_model(rt, "m"))
        block = block_of(rt, "m")
        rt.unload("m")
        assert not os.path.exists(block)
        assert f"unlinked shared-memory block /{os.path.basename(block)} (4.0 MiB)" in rt.log()


def test_a_pack_unlinks_a_dropped_models_block_and_keeps_its_neighbours():
    with Runtime(MODELS_PER_WORKER="4", MODEL_PACK_MAX_BYTES=str(64 * MiB)) as rt:
        for model_id in ("a", "b"):
            rt.load(model_id, block_model(rt, model_id))
        a, b = block_of(rt, "a"), block_of(rt, "b")
        rt.unload("a")
        assert not os.path.exists(a) and os.path.exists(b)
        assert f"unlinked shared-memory block /{os.path.basename(a)} (4.0 MiB) that a left" in rt.log()
        assert block_of(rt, "b") == b
        rt.unload("b")
        assert not os.path.exists(b)


def test_a_pack_unlinks_what_a_child_the_model_forked_made_and_what_a_failed_load_made():
    with Runtime(MODELS_PER_WORKER="4", MODEL_PACK_MAX_BYTES=str(64 * MiB)) as rt:
        rt.load("neighbour", block_model(rt, "neighbour"))
        rt.load("forking", block_model(rt, "forking", fork=""))
        assert len(rt.packs()) == 1  # both in one pack
        forked = block_of(rt, "forking")
        rt.unload("forking")
        assert not os.path.exists(forked)
        failing = block_model(rt, "failing", fail="")
        with pytest.raises(Exception, match="failing on purpose"):
            rt.load("failing", failing)
        made = os.path.join("/dev/shm", open(os.path.join(failing, "made")).read().lstrip("/"))
        assert not os.path.exists(made)
        assert os.path.exists(block_of(rt, "neighbour"))


@pytest.mark.parametrize("per_worker", ["1", "4"])
def test_a_model_that_only_attaches_to_a_block_leaves_it_to_its_maker(per_worker):
    with Runtime(MODELS_PER_WORKER=per_worker, MODEL_PACK_MAX_BYTES=str(64 * MiB)) as rt:
        rt.load("maker", block_model(rt, "maker"))
        block = block_of(rt, "maker")
        rt.load("reader", block_model(rt, "reader", attach=os.path.basename(block)))
        assert block_of(rt, "reader") == block
        rt.unload("reader")
        assert os.path.exists(block) and block_of(rt, "maker") == block
        rt.unload("maker")
        assert not os.path.exists(block)


def test_a_block_another_model_maps_outlives_its_makers_unload_until_the_runtime_stops(fixed_name):
    with Runtime() as rt:
        rt.load("maker", block_model(rt, "maker", fixed=fixed_name))
        rt.load("reader", block_model(rt, "reader", fixed=fixed_name))  # attaches: the name is taken
        block = block_of(rt, "maker")
        rt.unload("maker")
        assert os.path.exists(block) and block_of(rt, "reader") == block
    assert not os.path.exists(block)  # multiprocessing's tracker unlinked it as the runtime stopped


def test_a_model_that_unlinks_its_own_block_leaves_nothing_to_unlink():
    with Runtime() as rt:
        rt.load("m", block_model(rt, "m", tidy=""))
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


def test_the_blocks_of_a_killed_front_go_with_its_processes():
    first = Runtime().start()
    try:
        first.load("m", block_model(first, "m"))
        block, processes = block_of(first, "m"), tree(first.pid)
        first.process.kill()
        first.process.wait()
        wait_until(lambda: not alive(processes), timeout=10, what="the old tree to end")
        wait_until(lambda: not os.path.exists(block), timeout=10, what="the tracker to unlink the block")
    finally:
        first.stop()


def test_a_new_front_unlinks_the_blocks_an_earlier_ones_records_name(tmp_path, scratch_block):
    run_dir = str(tmp_path / "run")
    os.makedirs(shmblocks.records_folder(run_dir), mode=0o700)
    os.chmod(run_dir, 0o700)
    with open(os.path.join(shmblocks.records_folder(run_dir), "12345-678"), "w") as record:
        name = "/" + os.path.basename(scratch_block)
        record.write(json.dumps(["+", name, os.stat(scratch_block).st_ino, "m"]) + "\n")
    with Runtime(RUNTIME_DIR=run_dir) as rt:
        assert not os.path.exists(scratch_block)
        assert "that the models of worker 12345 left, under an earlier front" in rt.log()


@pytest.fixture
def scratch_block(fixed_name):
    path = f"/dev/shm/{fixed_name}"
    with open(path, "wb") as block:
        block.write(b"x" * 8192)
    return path


def write_record(path: str, *lines: list) -> None:
    with open(path, "w") as record:
        record.writelines(json.dumps(line) + "\n" for line in lines)
        record.write('["+", "/cut-sho')  # a line cut short by a kill


def test_a_record_unlinks_only_the_file_made_that_nothing_maps(tmp_path, scratch_block):
    name, inode = "/" + os.path.basename(scratch_block), os.stat(scratch_block).st_ino
    record, forgotten = str(tmp_path / "1-2"), []
    write_record(record, ["+", name, inode + 1, "m"])  # another file of the same name, gone since
    assert shmblocks.unlink_recorded(record, os.getpid(), forgotten.append) == []
    assert os.path.exists(scratch_block) and not os.path.exists(record)
    write_record(record, ["+", name, inode, "m"], ["-", name])  # unlinked by its model
    assert shmblocks.unlink_recorded(record, os.getpid(), forgotten.append) == []
    with open(scratch_block, "r+b") as file:
        import mmap

        with mmap.mmap(file.fileno(), 8192):  # this process maps it
            write_record(record, ["+", name, inode, "m"])
            assert shmblocks.unlink_recorded(record, os.getpid(), forgotten.append) == []
    write_record(record, ["+", "/../tmp", 1, "m"], ["+", name, inode, None])
    assert shmblocks.unlink_recorded(record, os.getpid(), forgotten.append) == [(name, 8192)]
    assert not os.path.exists(scratch_block) and forgotten == [name]


def test_a_record_keeps_to_the_blocks_still_live(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "register_at_fork", lambda **_: None)
    notes = shmblocks.BlockNotes(str(tmp_path / "1-2"), os.getpid(), lambda name: None)
    kept = {(f"/kept{n}", n): "m" for n in range(100)}
    for (name, inode), owner in kept.items():
        notes._write(["+", name, inode, owner])
    for n in range(shmblocks.COMPACT_AFTER_LINES):  # a scratch block made and unlinked per call
        notes._write(["+", f"/scratch{n}", 1000 + n, "m"])
        notes._write(["-", f"/scratch{n}"])
    assert len(open(notes.record).readlines()) < 4 * len(kept)
    assert shmblocks.recorded_blocks(notes.record) == kept


def test_a_forked_child_appends_to_the_record_and_leaves_compacting_to_its_worker(tmp_path, monkeypatch):
    monkeypatch.setattr(shmblocks, "COMPACT_AFTER_LINES", 4)
    notes = shmblocks.BlockNotes(str(tmp_path / "1-2"), os.getpid(), lambda name: None)
    notes._write(["+", "/kept", 1, "m"])
    child = os.fork()
    if child == 0:  # a helper the model forked, making and unlinking blocks
        for n in range(20):
            notes._write(["+", f"/scratch{n}", 10 + n, "m"])
            notes._write(["-", f"/scratch{n}"])
        os._exit(0)
    os.waitpid(child, 0)
    assert len(open(notes.record).readlines()) == 41  # nothing rewritten under the worker
    notes._write(["+", "/late", 2, "m"])  # the worker's next line compacts
    assert shmblocks.recorded_blocks(notes.record) == {("/kept", 1): "m", ("/late", 2): "m"}


def test_a_worker_that_cannot_keep_a_record_leaves_its_blocks_to_the_tracker(tmp_path, caplog):
    blocked = tmp_path / "run"
    blocked.write_text("a file where the folder would be")
    assert shmblocks.note_blocks(str(blocked), os.getpid()) is None
    assert "cannot record the shared-memory blocks" in caplog.text


def test_names_outside_dev_shm_name_no_block():
    assert shmblocks.block_path("/psm_1a2b") == "/dev/shm/psm_1a2b"
    for name in ("/", "", "/..", "/.", "a/b", "/../etc/passwd"):
        assert shmblocks.block_path(name) is None


def test_a_record_is_named_by_the_workers_start_too():
    identity = lifeline.process_identity(os.getpid())
    assert shmblocks.record_path("/run", identity) == "/run/shm/{}-{}".format(*identity)
