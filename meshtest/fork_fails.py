"""Preloaded by a test into the fork server (WORKER_PRELOAD): while the file MESH_TEST_FORK_FAILS
names exists, its forks fail with EAGAIN, as they do at the pids cgroup's pids.max."""

import errno
import os

_real_fork = os.fork


def _fork() -> int:
    if os.path.exists(os.environ.get("MESH_TEST_FORK_FAILS", "")):
        raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
    return _real_fork()


os.fork = _fork
