"""Python stacks of a running process, on demand, without stopping it.

A worker registers faulthandler for SIGUSR1 at start; the admin `stacks`
command signals it and reads the file it wrote (runtime/admin/stacks.py).
"""

import os
import signal


def stacks_path(runtime_dir: str, pid: int) -> str:
    """Where a worker's faulthandler writes its thread stacks on SIGUSR1."""
    return os.path.join(runtime_dir, "stacks", str(pid))


def dump_stacks_on_sigusr1(runtime_dir: str) -> None:
    """Lets the front read this process's Python stacks without stopping it."""
    import faulthandler

    path = stacks_path(runtime_dir, os.getpid())
    # Private, and never through a symlink: the stacks may show model data.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    stacks_file = open(fd, "a")  # kept open for the life of the process
    faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)
