"""Shared-memory blocks a model makes go with the model, not with the runtime.

`multiprocessing.shared_memory` registers each block it makes with
multiprocessing's resource tracker, which unlinks what is left only when the
tracker ends: for a worker forked by the fork server, when the runtime stops.
A block a model never unlinks would keep its memory charged to the pod after
the model's unload, while the front said the memory was back.

So a worker also notes each block its models make (`note_blocks`: not those
they only attach to by name), with the model whose code made it, in a record
file RUNTIME_DIR/shm/<pid>-<start time> that the processes it forks append to
as well. A pack unlinks a dropped model's blocks, or those of a load that
failed (`BlockNotes.unlink_blocks_of`); the front unlinks whatever a worker's
record still names once the worker is reaped, however it ended
(`unlink_recorded`), and a front what the workers of an earlier one left. The
tracker still hears of every block, so that what is left when the runtime dies
goes then, as before.

A block is left alone while any process of the runtime maps it (a model that
attaches to a fixed name, say, as it reloads in a fresh pack before the old one
ends), and is unlinked only while /dev/shm holds the very file its model made
(the same inode). A block made on a thread the model started itself has no
model: in a pack it goes when the pack ends.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Sized
from typing import Any

from plumbing import lifeline

log = logging.getLogger("mesh.shm")

SHM_FOLDER = "/dev/shm"
RESOURCE_TYPE = "shared_memory"  # multiprocessing.resource_tracker's name for these blocks
COMPACT_AFTER_LINES = 256  # a record rewritten once it has this many lines, four times those still live

Block = tuple[str, int]  # (name as registered, inode)


def records_folder(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, "shm")


def record_path(runtime_dir: str, identity: lifeline.Identity) -> str:
    """Where the worker named by `identity` (pid, start time) records its models' blocks: a pid
    alone may be a later worker's by the time the front reaps this one."""
    return os.path.join(records_folder(runtime_dir), "{}-{}".format(*identity))


def block_path(name: str) -> str | None:
    """/dev/shm's file for a registered name ("/psm_1a2b"); None for one that names no file there."""
    bare = name[1:] if name.startswith("/") else name
    if not bare or "/" in bare or bare in (".", ".."):
        return None
    return os.path.join(SHM_FOLDER, bare)


class BlockNotes:
    """In a worker: notes the blocks its models make in its record, and unlinks them."""

    def __init__(self, record: str, runtime_root: int, forget: Callable[[str], None]):
        self.record = record
        self.runtime_root = runtime_root  # the front's pid: its processes may map a block
        self._forget = forget  # tells multiprocessing's tracker a block is unlinked
        self._fd = os.open(
            record, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        self._lines = 0  # in the record, as this process wrote it
        self._compact_at = COMPACT_AFTER_LINES
        self._pid = os.getpid()  # a child it forks appends, and leaves the compacting to it
        self._lock = threading.Lock()
        # .model_id: whose code runs on the thread; .creating: in SharedMemory(create=True)
        self._thread = threading.local()
        os.register_at_fork(after_in_child=self._after_fork)

    def made_by(self, model_id: str | None) -> None:
        """Says whose code this thread runs now: the blocks it makes are that model's."""
        self._thread.model_id = model_id

    def creating(self, yes: bool) -> None:
        self._thread.creating = yes

    def registered(self, name: str) -> None:
        if not getattr(self._thread, "creating", False):
            return  # an attach by name: the block is its maker's
        path = block_path(name)
        try:
            inode = os.stat(path).st_ino if path else None
        except OSError:
            return
        if inode is not None:
            self._write(["+", name, inode, getattr(self._thread, "model_id", None)])

    def unregistered(self, name: str) -> None:
        """Its model unlinked it (or one that attached to it did)."""
        self._write(["-", name])

    def unlink_blocks_of(self, model_id: str) -> list[tuple[str, int]]:
        """Unlinks the blocks the model made and left: [(name, bytes)]."""
        blocks = [block for block, owner in recorded_blocks(self.record).items() if owner == model_id]
        unlinked = unlink_blocks(blocks, self.runtime_root, self._forget)
        for name, _ in unlinked:
            self._write(["-", name])
        return unlinked

    def _write(self, line: list[Any]) -> None:
        with self._lock:
            try:
                os.write(self._fd, (json.dumps(line) + "\n").encode())
                self._lines += 1
                if self._lines >= self._compact_at and os.getpid() == self._pid:
                    self._compact()
            except OSError as error:  # a full disk: the tracker still unlinks it when the runtime stops
                log.warning("could not record shared-memory block %s: %s", line[1], error)

    def _compact(self) -> None:
        """Rewrites the record with only the blocks still live, once most of its lines cancel out;
        the next time it has four times as many lines as it kept, or COMPACT_AFTER_LINES."""
        live = recorded_blocks(self.record)
        if len(live) * 4 <= self._lines:
            os.ftruncate(self._fd, 0)
            lines = (json.dumps(["+", *block, owner]) + "\n" for block, owner in live.items())
            os.write(self._fd, "".join(lines).encode())
            self._lines = len(live)
        self._compact_at = max(COMPACT_AFTER_LINES, 4 * len(live))

    def _after_fork(self) -> None:
        self._lock = threading.Lock()  # another thread may have held it at the fork


def note_blocks(runtime_dir: str, runtime_root: int) -> BlockNotes | None:
    """Makes this process note the blocks its models make, beside multiprocessing's resource
    tracker; None where it cannot keep a record (the tracker alone unlinks them then)."""
    from multiprocessing import resource_tracker, shared_memory

    register, unregister = resource_tracker.register, resource_tracker.unregister
    identity = lifeline.process_identity(os.getpid())
    assert identity is not None  # this very process
    try:
        os.makedirs(records_folder(runtime_dir), mode=0o700, exist_ok=True)
        record = record_path(runtime_dir, identity)
        notes = BlockNotes(record, runtime_root, lambda name: unregister(name, RESOURCE_TYPE))
    except OSError as error:
        log.warning(
            "cannot record the shared-memory blocks models make (%s): they stay until the runtime stops",
            error,
        )
        return None

    def registering(name: Sized, rtype: str) -> None:
        register(name, rtype)
        if rtype == RESOURCE_TYPE and isinstance(name, str):
            notes.registered(name)

    def unregistering(name: Sized, rtype: str) -> None:
        unregister(name, rtype)
        if rtype == RESOURCE_TYPE and isinstance(name, str):
            notes.unregistered(name)

    making = shared_memory.SharedMemory.__init__

    def init(
        self: shared_memory.SharedMemory,
        name: str | None = None,
        create: bool = False,
        size: int = 0,
        **more: Any,
    ) -> None:
        notes.creating(bool(create))  # registering() tells a block made from one attached to by name
        try:
            making(self, name, create, size, **more)
        finally:
            notes.creating(False)

    resource_tracker.register, resource_tracker.unregister = registering, unregistering
    shared_memory.SharedMemory.__init__ = init  # type: ignore[method-assign]
    return notes


def unlink_blocks(
    blocks: Iterable[Block], runtime_root: int, forget: Callable[[str], None], ending_group: int | None = None
) -> list[tuple[str, int]]:
    """Unlinks each block whose file is still the one made and that no process of the runtime (the
    tree below `runtime_root`, but for those of `ending_group`, a reaped worker's) maps:
    [(name, bytes it held)]. `forget` tells the tracker."""
    found = []
    for name, inode in blocks:
        path = block_path(name)
        try:
            info = os.lstat(path) if path else None
        except OSError:
            continue  # unlinked meanwhile
        if path and info and info.st_ino == inode:
            found.append((name, path, info.st_blocks * 512))
    processes = [runtime_root, *lifeline.descendants(runtime_root)] if found else []
    in_use = mapped([path for _, path, _ in found], processes, ending_group)
    unlinked = []
    for name, path, size in found:
        if path in in_use:
            continue  # another model's by now: it goes when the runtime stops, if not before
        try:
            os.unlink(path)
        except OSError:
            continue
        forget(name)
        unlinked.append((name, size))
    return unlinked


def mapped(paths: list[str], pids: Iterable[int], ending_group: int | None = None) -> set[str]:
    """Those of `paths` that a living process of `pids` maps (not one of `ending_group`)."""
    wanted, found = set(paths), set()
    for pid in pids:
        try:
            identity = lifeline.process_identity(pid)
            if identity is None or not lifeline.lives(identity) or os.getpgid(pid) == ending_group:
                continue
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    path = "/" + line.rstrip("\n").partition(" /")[2]
                    if path in wanted:
                        found.add(path)
        except OSError:
            continue
    return found


def recorded_blocks(record: str) -> dict[Block, str | None]:
    """The blocks a record names as made and not unlinked, with the model that made each."""
    live: dict[str, tuple[int, str | None]] = {}  # by name: /dev/shm holds one file of a name at a time
    try:
        with open(os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)) as lines:
            for line in lines:
                try:
                    op, name, *rest = json.loads(line)
                except (ValueError, TypeError):
                    continue  # a line cut short by a kill
                if op == "+" and isinstance(name, str) and len(rest) == 2 and isinstance(rest[0], int):
                    live[name] = (rest[0], rest[1] if isinstance(rest[1], str) else None)
                elif op == "-":
                    live.pop(name, None)
    except OSError:
        return {}
    return {(name, inode): owner for name, (inode, owner) in live.items()}


def unlink_recorded(
    record: str, runtime_root: int, forget: Callable[[str], None], ending_group: int | None = None
) -> list[tuple[str, int]]:
    """Once the worker that wrote the record is gone: unlinks the blocks it left, and the record."""
    unlinked = unlink_blocks(list(recorded_blocks(record)), runtime_root, forget, ending_group)
    try:
        os.unlink(record)
    except OSError:
        pass
    return unlinked
