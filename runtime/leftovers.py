"""A record, in RUNTIME_DIR, of every process the front started, so that the
next front on the same RUNTIME_DIR can kill whatever an earlier one left (the
folders for what each worker writes there are made here too); and
the shared-memory blocks a worker's models left, unlinked once it is reaped
(plumbing/shmblocks.py), or by the next front if this one is killed first;
and multiprocessing's temp folder ($TMPDIR/pymp-*, its fork servers' listener
sockets), which multiprocessing removes only as the front exits normally.

Each process is a file `pids/<pid>` holding its start time: a pid alone could
by now belong to an unrelated process, a pid with the same start time cannot.
A record alone is no licence to kill, though: the purge kills only a process
of the runtime's uid whose title marks it as a mesh-runtime process of this
very RUNTIME_DIR (plumbing/titles.py), and leaves anything else alone.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import shutil
import signal
import stat
import time
from collections.abc import Callable
from multiprocessing import resource_tracker
from multiprocessing import util as multiprocessing_util

import psutil

from plumbing import lifeline, shmblocks, stacks, titles
from runtime import rundir

log = logging.getLogger("mesh.leftovers")

# Start times read twice from /proc can differ in the last digits.
_SAME_START_SECONDS = 0.05
_RECORD_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


class ProcessRegistry:
    def __init__(self, runtime_dir: str):
        self.runtime_dir = runtime_dir
        self.folder = os.path.join(runtime_dir, "pids")
        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        os.makedirs(shmblocks.records_folder(runtime_dir), mode=0o700, exist_ok=True)
        os.makedirs(os.path.dirname(stacks.stacks_path(runtime_dir, 0)), mode=0o700, exist_ok=True)

    def add(self, pid: int) -> None:
        """Records a process just started. One that cannot be recorded (a full disk) runs on all the
        same, watched by the front, and watching it: raising here would leave it unwatched."""
        try:
            started = psutil.Process(pid).create_time()
        except psutil.NoSuchProcess:
            return
        path = os.path.join(self.folder, str(pid))
        try:
            _write_record(path, repr(started))
        except OSError as error:
            log.warning(
                "pid %d is not recorded in %s (%s): a later front cannot clean it up", pid, path, error
            )

    def record_temp_folder(self) -> None:
        """Records multiprocessing's temp folder, for the next front to remove if this one is killed."""
        path = multiprocessing_util.get_temp_dir()
        record = os.path.join(self.runtime_dir, rundir.TEMP_FOLDER_RECORD)
        try:
            _write_record(record, path)
        except OSError as error:  # a full disk: the folder may outlive a SIGKILL, nothing worse
            log.warning("cannot record multiprocessing's temp folder %s: %s", path, error)

    def remove(self, pid: int, identity: lifeline.Identity | None = None) -> None:
        """Forgets a reaped process (its record, its stack dump), and unlinks the shared-memory blocks
        a worker's models left (`identity`: the worker's, as it was started). Blocking: the unlinks
        free their memory."""
        for path in (os.path.join(self.folder, str(pid)), stacks.stacks_path(self.runtime_dir, pid)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if identity is not None:
            record = shmblocks.record_path(self.runtime_dir, identity)
            # Multiprocessing's tracker, which the workers share, is this process's: it forgets them.
            forget = functools.partial(resource_tracker.unregister, rtype=shmblocks.RESOURCE_TYPE)
            self._unlink_blocks_left(record, forget, ending_group=pid)

    def purge(self, wait_seconds: float = 5.0) -> list[int]:
        """SIGKILLs every recorded process that still runs and is ours to kill; returns their pids."""
        survivors = []
        for name in os.listdir(self.folder):
            process = self._recorded_process(name)
            if process is not None and self._is_ours_to_kill(process):
                survivors.append(process)
            _discard(os.path.join(self.folder, name))
        for process in survivors:
            log.warning("killing pid %d, left behind by an earlier runtime on this RUNTIME_DIR", process.pid)
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + wait_seconds
        while any(_running(p) for p in survivors) and time.monotonic() < deadline:
            time.sleep(0.02)
        stuck = [p.pid for p in survivors if _running(p)]
        if stuck:
            log.error("pids %s survived SIGKILL", stuck)
        folder = shmblocks.records_folder(self.runtime_dir)
        for name in os.listdir(folder):  # the earlier front's tracker is gone, ours never knew them
            self._unlink_blocks_left(os.path.join(folder, name), forget=lambda name: None)
        dumps = os.path.dirname(stacks.stacks_path(self.runtime_dir, 0))
        for name in os.listdir(dumps):  # the stacks its workers wrote: none of ours yet
            _discard(os.path.join(dumps, name))
        self._remove_temp_folder_left()
        return [p.pid for p in survivors]

    def _remove_temp_folder_left(self) -> None:
        """Removes the multiprocessing temp folder an earlier front recorded, if it is still there.

        Only a folder of our uid named as multiprocessing names them: whoever could once write into
        RUNTIME_DIR could have planted the record."""
        record = os.path.join(self.runtime_dir, rundir.TEMP_FOLDER_RECORD)
        try:
            with open(os.open(record, os.O_RDONLY | _RECORD_FLAGS)) as f:
                path = f.read()
        except (OSError, ValueError):
            return
        try:
            info = os.lstat(path)
            if os.path.basename(path).startswith("pymp-") and stat.S_ISDIR(info.st_mode):
                if info.st_uid == os.getuid():
                    shutil.rmtree(path)
                    log.info("removed %s, multiprocessing's temp folder of an earlier front", path)
        except OSError as error:
            if error.errno != errno.ENOENT:  # gone with a clean stop: nothing to say
                log.warning("cannot remove an earlier front's temp folder %s: %s", path, error)
        _discard(record)

    def _unlink_blocks_left(
        self, record: str, forget: Callable[[str], None], ending_group: int | None = None
    ) -> None:
        worker = os.path.basename(record)
        try:
            unlinked = shmblocks.unlink_recorded(record, os.getpid(), forget, ending_group)
        except Exception:  # the reap goes on: a block left stays until the runtime stops
            log.exception("unlinking the shared-memory blocks that worker %s left failed", worker)
            return
        for name, size in unlinked:
            log.info(
                "unlinked shared-memory block %s (%.1f MiB) that the models of worker %s left%s",
                name,
                size / 2**20,
                worker.partition("-")[0],
                "" if ending_group else ", under an earlier front",
            )

    def _recorded_process(self, name: str) -> psutil.Process | None:
        """The running process a record names, if it is still the one recorded."""
        try:
            with open(os.open(os.path.join(self.folder, name), os.O_RDONLY | _RECORD_FLAGS)) as record:
                started = float(record.read())
            process = psutil.Process(int(name))
            if abs(process.create_time() - started) > _SAME_START_SECONDS or process.pid == os.getpid():
                return None
            return process if _running(process) else None
        except (ValueError, OSError, psutil.Error):
            return None

    def _is_ours_to_kill(self, process: psutil.Process) -> bool:
        """Only a process of our uid titled as a mesh-runtime process of this RUNTIME_DIR.

        Anyone who could once write into the folder could have planted a
        record naming a process of theirs, or any process at all.
        """
        try:
            uids, cmdline = process.uids(), process.cmdline()
        except psutil.Error:
            return False
        ours = os.getuid()
        if uids.real != ours or uids.effective != ours:
            stranger = uids.real if uids.real != ours else uids.effective
            log.warning(
                "leaving pid %d alone: it runs as uid %d, not as the runtime's uid %d",
                process.pid,
                stranger,
                ours,
            )
            return False
        if not titles.is_runtime_process_of(cmdline, self.runtime_dir):
            shown = " ".join(part for part in cmdline if part)[:120]
            log.warning(
                "leaving pid %d alone: its title %r does not mark it as a mesh-runtime process of %s",
                process.pid,
                shown,
                self.runtime_dir,
            )
            return False
        return True


def _write_record(path: str, text: str) -> None:
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _RECORD_FLAGS, 0o600), "w") as record:
        record.write(text)


def _discard(path: str) -> None:
    """Removes what is at path in one of the runtime's folders, a folder whole (no front makes one
    there, but whatever is in them is the runtime's: a stop removes them whole too)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def _running(process: psutil.Process) -> bool:
    """True while the process exists and is not a zombie (a zombie holds no memory)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
