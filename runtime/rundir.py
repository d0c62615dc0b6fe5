"""RUNTIME_DIR: the private folder for worker sockets, the process registry and the front's lock.

Only the runtime's user may enter it (mode 0700), so nobody else can connect
to a worker socket. What is in it is trusted only as far as nobody else could
have written it:

- a symlink, or a folder that belongs to another uid, is refused;
- a folder of ours that others could write to (group or other write bits),
  or one whose runtime entries (ENTRIES) hold a symlink or anything not ours
  or writable by others, has those entries removed (without following a
  symlink, and killing nothing their records name) and is made 0700: a
  record of "our" processes in it may be planted. Anything else in the
  folder is the operator's and stays: the runtime never reads it;
- a private folder whose runtime entries are all ours and writable by us
  alone is kept: the records of an earlier front's processes in it are the
  purge's to act on (runtime/leftovers.py). Read bits do not matter inside a
  0700 folder, nor a socket's write bits: it holds nothing anyone could
  plant, and its mode follows the umask (0002 makes ours group-writable).

One front per folder: the front holds an exclusive flock on `front.lock` in
it for its whole life, and a second front on the same folder stops before it
changes anything in it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import stat

log = logging.getLogger("mesh.rundir")

# sockaddr_un holds 108 bytes; ipc:// addresses must fit with their file name.
MAX_SOCKET_PATH = 100
LOCK_NAME = "front.lock"
# Everything the runtime makes in RUNTIME_DIR: a stop removes these and leaves anything else. The
# `own` of the functions below adds RUNTIME_SOCKET_PATH's name when the socket is in the folder.
# The record of multiprocessing's temp folder, which is outside RUNTIME_DIR (runtime/leftovers.py).
TEMP_FOLDER_RECORD = "mp-tempdir"
ENTRIES = (
    LOCK_NAME,
    "workers.sock",
    "lanes.sock",
    "admin.sock",
    "beats",
    "pids",
    "stacks",
    "shm",
    TEMP_FOLDER_RECORD,
)
_OTHERS_MAY_WRITE = stat.S_IWGRP | stat.S_IWOTH


class RuntimeDirError(RuntimeError):
    pass


class Lock:
    """A front's exclusive hold on its RUNTIME_DIR, released on close or when the process ends."""

    def __init__(self, fd: int):
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def names_in(path: str, *files: str | None) -> tuple[str, ...]:
    """The names of those of `files` right in the folder `path`: what else of the runtime's is in it."""
    return tuple(os.path.basename(f) for f in files if f and os.path.dirname(f) == path)


def prepare(path: str, own: tuple[str, ...] = ()) -> Lock:
    """Makes RUNTIME_DIR ours and private and locks it for this front; raises RuntimeDirError if it cannot.

    The contents are judged, and emptied if untrusted, only once the lock is
    held: a second front must not empty the folder of a front that runs.
    """
    if len(os.path.join(path, "workers.sock")) > MAX_SOCKET_PATH:
        raise RuntimeDirError(
            f"RUNTIME_DIR: {path} is too long for unix sockets (keep it under 85 characters)"
        )
    loose = make_private(path)
    lock = take_lock(path)
    try:
        reason = loose or find_untrusted_entry(path, own)
        if reason:
            log.warning("RUNTIME_DIR %s is not trusted: %s; removing the runtime's entries", path, reason)
            empty(path, own)
    except BaseException:
        lock.close()
        raise
    return lock


def make_private(path: str) -> str | None:
    """Creates the folder or refuses a foreign one, then makes it 0700.

    Returns why it was not trusted, if others could write to it.
    """
    info = _lstat_or_make(path)
    if stat.S_ISLNK(info.st_mode):
        raise RuntimeDirError(f"RUNTIME_DIR: {path} is a symlink; give the folder itself, not a link to it")
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"RUNTIME_DIR: {path} is not a folder")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise RuntimeDirError(f"RUNTIME_DIR: cannot open {path}: {error.strerror}") from None
    # Judged and changed by descriptor: the very folder opened, whatever became of the path.
    # Made 0700 before anything in it is removed: from here on nobody else may add to it.
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise RuntimeDirError(
                f"RUNTIME_DIR: {path} belongs to uid {info.st_uid}, not to the runtime's uid {os.getuid()}"
            )
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    if info.st_mode & _OTHERS_MAY_WRITE:
        return f"the folder was writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    return None


def _lstat_or_make(path: str) -> os.stat_result:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        raise RuntimeDirError(f"RUNTIME_DIR: cannot reach {path}: {error.strerror}") from None
    try:
        os.makedirs(path, mode=0o700)
    except FileExistsError:
        pass  # made meanwhile: judged like any other
    except OSError as error:
        raise RuntimeDirError(f"RUNTIME_DIR: cannot create {path}: {error.strerror}") from None
    return os.lstat(path)


def take_lock(path: str) -> Lock:
    """The exclusive flock on RUNTIME_DIR/front.lock, with our pid written in it.

    Refused (RuntimeDirError) if another front holds it.
    """
    lock_path = os.path.join(path, LOCK_NAME)
    _drop_untrusted(lock_path)
    try:
        # O_CLOEXEC: a child that outlived the front must not keep its lock.
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as error:
        raise RuntimeDirError(f"RUNTIME_DIR: cannot open {lock_path}: {error.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RuntimeDirError(
            f"RUNTIME_DIR: {path} is in use by another front (pid {holder}); one front per RUNTIME_DIR"
        ) from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as error:  # a full disk: one line, as for the other refusals, not a traceback
        os.close(fd)
        raise RuntimeDirError(f"RUNTIME_DIR: cannot write {lock_path}: {error.strerror}") from None
    return Lock(fd)


def _drop_untrusted(lock_path: str) -> None:
    """Removes a lock file that no front of ours could have made: a front never holds such a one."""
    try:
        info = os.lstat(lock_path)
    except FileNotFoundError:
        return
    reason = _distrust(lock_path, info) or (
        None if stat.S_ISREG(info.st_mode) else "it is not a regular file"
    )
    if reason:
        log.warning("RUNTIME_DIR lock file %s is not trusted: %s; replacing it", lock_path, reason)
        try:
            _remove_entry(lock_path, info)
        except OSError as error:
            raise RuntimeDirError(f"RUNTIME_DIR: cannot remove the untrusted {lock_path}: {error}") from None


def find_untrusted_entry(path: str, own: tuple[str, ...] = ()) -> str | None:
    """Why the first of the runtime's entries in path (and what is below them) that someone else
    could have written is not trusted; None if none is. Other files are never read: they do not count."""
    for name in (*ENTRIES, *own):
        top = os.path.join(path, name)
        try:
            reason = _distrust(top, os.lstat(top))
        except FileNotFoundError:
            continue
        if reason:
            return reason
        for folder, folders, files in os.walk(top):  # does not follow symlinks; nothing for a file
            for below in folders + files:
                entry = os.path.join(folder, below)
                try:
                    reason = _distrust(entry, os.lstat(entry))
                except FileNotFoundError:
                    continue  # gone since it was listed
                if reason:
                    return reason
    return None


def _distrust(entry: str, info: os.stat_result) -> str | None:
    if stat.S_ISLNK(info.st_mode):
        return f"{entry} is a symlink"
    if info.st_uid != os.getuid():
        return f"{entry} belongs to uid {info.st_uid}"
    if info.st_mode & _OTHERS_MAY_WRITE and not stat.S_ISSOCK(info.st_mode):
        return f"{entry} is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
    if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:  # a link to a file of ours elsewhere
        return f"{entry} has {info.st_nlink} hard links"
    return None


def empty(path: str, own: tuple[str, ...] = ()) -> None:
    """Removes the runtime's entries in path but the lock, following no symlink (a symlink itself
    is removed); what else is in it stays: the runtime never reads it."""
    for name in (*ENTRIES, *own):
        entry = os.path.join(path, name)
        try:
            if name != LOCK_NAME:
                _remove_entry(entry, os.lstat(entry))
        except FileNotFoundError:
            pass
        except OSError as error:
            raise RuntimeDirError(f"RUNTIME_DIR: cannot empty {path}: {error}") from None


def _remove_entry(entry: str, info: os.stat_result) -> None:
    if stat.S_ISDIR(info.st_mode):
        shutil.rmtree(entry)  # works by descriptor on Linux: a symlink inside is removed, never entered
    else:
        os.unlink(entry)


def remove(path: str, own: tuple[str, ...] = ()) -> None:
    """Removes what the runtime made in path, then path itself if that leaves it empty: a folder
    given with files of its own keeps them."""
    for name in (*ENTRIES, *own):
        entry = os.path.join(path, name)
        try:
            _remove_entry(entry, os.lstat(entry))
        except FileNotFoundError:
            pass
        except OSError as error:
            log.warning("cannot remove %s: %s", entry, error)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as error:
        why = "it holds files the runtime did not make" if error.errno == errno.ENOTEMPTY else error.strerror
        log.info("RUNTIME_DIR %s kept: %s", path, why)
