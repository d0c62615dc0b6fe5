"""RUNTIME_DIR: the private folder for worker sockets and the process registry.

Only the runtime's user may enter it (mode 0700), so nobody else can connect
to a worker socket. A folder that exists but belongs to someone else, or is a
symlink, is refused rather than trusted.
"""
from __future__ import annotations

import os
import shutil
import stat

# sockaddr_un holds 108 bytes; ipc:// addresses must fit with their file name.
MAX_SOCKET_PATH = 100


class RuntimeDirError(RuntimeError):
    pass


def prepare(path: str) -> str:
    if len(os.path.join(path, "workers.sock")) > MAX_SOCKET_PATH:
        raise RuntimeDirError(f"RUNTIME_DIR: {path} is too long for unix sockets (keep it under 85 characters)")
    os.makedirs(path, mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise RuntimeDirError(f"RUNTIME_DIR: {path} is not a folder")
    if info.st_uid != os.getuid():
        raise RuntimeDirError(f"RUNTIME_DIR: {path} belongs to uid {info.st_uid}, not to us")
    os.chmod(path, 0o700)
    return path


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
