"""Shared-memory blocks a model makes go with the model, not with the runtime.

`multiprocessing.shared_memory` registers each block it makes (or, before
Python 3.13, attaches to) with multiprocessing's resource tracker, which
unlinks what is left only when the tracker ends: in a worker forked by the
fork server, when the runtime stops. A block a model never unlinks would keep
its memory charged to the pod after the model's unload, while the front said
the memory was back.

So a worker notes the registrations itself (`note_blocks`): each block with the
model whose code made it (`made_by`), in memory and in a record file,
RUNTIME_DIR/shm/<worker pid>, that the processes it forks append to as well.
A pack unlinks a dropped model's blocks at the drop (`unlink_blocks_of`); the
front unlinks whatever a worker's record still names once the worker is
reaped, however it ended (`unlink_recorded`), and what the workers of an
earlier front left, at start. A block is unlinked only while /dev/shm holds
the very file that was registered (the same inode): a later block of the same
name is another's. A block shared by name with another model loses its name
(not its memory, while mapped) when the model that registered it goes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterable, Sized

log = logging.getLogger("mesh.shm")

SHM_FOLDER = "/dev/shm"
RESOURCE_TYPE = "shared_memory"  # multiprocessing.resource_tracker's name for these blocks

Block = tuple[str, int]  # (name as registered, inode)


def records_folder(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, "shm")


def record_path(runtime_dir: str, pid: int) -> str:
    """Where the worker of this pid records the blocks its models registered."""
    return os.path.join(records_folder(runtime_dir), str(pid))


def block_path(name: str) -> str | None:
    """/dev/shm's file for a registered name ("/psm_1a2b"); None for one that names no file there."""
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare or bare in (".", ".."):
        return None
    return os.path.join(SHM_FOLDER, bare)


class BlockNotes:
    """In a worker: the blocks its models registered and not yet unlinked, by the model that made them."""

    def __init__(self, record: str):
        self._fd = os.open(
            record, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        self._owners: dict[Block, str | None] = {}
        self._lock = threading.Lock()
        self._running = threading.local()
        os.register_at_fork(after_in_child=self._after_fork)

    def made_by(self, model_id: str | None) -> None:
        """Says whose code this thread runs now: the blocks it registers are that model's."""
        self._running.model_id = model_id

    def registered(self, name: str) -> None:
        block = _block_of(name)
        if block is None:
            return
        with self._lock:
            self._owners[block] = getattr(self._running, "model_id", None)
            self._write("+", block)

    def unregistered(self, name: str) -> None:
        with self._lock:
            for block in [b for b in self._owners if b[0] == name]:
                del self._owners[block]
                self._write("-", block)

    def unlink_blocks_of(self, model_id: str) -> list[tuple[str, int]]:
        """Unlinks the blocks the model registered and left: [(name, bytes)]."""
        with self._lock:
            mine = [block for block, owner in self._owners.items() if owner == model_id]
            for block in mine:
                del self._owners[block]
                self._write("-", block)
        return unlink_blocks(mine)

    def _write(self, op: str, block: Block) -> None:
        try:
            os.write(self._fd, (json.dumps([op, *block]) + "\n").encode())
        except OSError as error:  # a full disk: the front cannot unlink it, the pack's drop still does
            log.warning("could not record shared-memory block %s: %s", block[0], error)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork


def _block_of(name: str) -> Block | None:
    path = block_path(name)
    try:
        return (name, os.stat(path).st_ino) if path else None
    except OSError:
        return None


def note_blocks(runtime_dir: str) -> BlockNotes:
    """Makes this process note its models' blocks instead of multiprocessing's resource tracker."""
    from multiprocessing import resource_tracker

    notes = BlockNotes(record_path(runtime_dir, os.getpid()))
    register, unregister = resource_tracker.register, resource_tracker.unregister

    def registering(name: Sized, rtype: str) -> None:
        if rtype == RESOURCE_TYPE and isinstance(name, str):
            notes.registered(name)
        else:
            register(name, rtype)

    def unregistering(name: Sized, rtype: str) -> None:
        if rtype == RESOURCE_TYPE and isinstance(name, str):
            notes.unregistered(name)
        else:
            unregister(name, rtype)

    resource_tracker.register, resource_tracker.unregister = registering, unregistering
    return notes


def unlink_blocks(blocks: Iterable[Block]) -> list[tuple[str, int]]:
    """Unlinks each block whose file is still the one registered: [(name, bytes it held)]."""
    unlinked = []
    for name, inode in blocks:
        path = block_path(name)
        try:
            info = os.stat(path) if path else None
            if path and info and info.st_ino == inode:
                os.unlink(path)
                unlinked.append((name, info.st_blocks * 512))
        except OSError:
            continue  # unlinked meanwhile, or not ours to unlink
    return unlinked


def recorded_blocks(record: str) -> list[Block]:
    """The blocks a record names as registered and not unlinked."""
    live: dict[Block, None] = {}
    try:
        with open(os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)) as lines:
            for line in lines:
                try:
                    op, name, inode = json.loads(line)
                except (ValueError, TypeError):
                    continue  # a line cut short by a kill
                if not (isinstance(name, str) and isinstance(inode, int)):
                    continue
                if op == "+":
                    live[(name, inode)] = None
                elif op == "-":
                    live.pop((name, inode), None)
    except OSError:
        return []
    return list(live)


def unlink_recorded(record: str) -> list[tuple[str, int]]:
    """Once the worker that wrote the record is gone: unlinks the blocks it left, and the record."""
    unlinked = unlink_blocks(recorded_blocks(record))
    try:
        os.unlink(record)
    except OSError:
        pass
    return unlinked
