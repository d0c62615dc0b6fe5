"""Imported once inside the fork server, before it forks any worker.

multiprocessing's fork server imports its preload list at start; this module
is that list's only entry. It ties the fork server's life to the front's
(parent-death signal), imports WORKER_PRELOAD modules plus the worker's own
code so that a new worker starts in milliseconds, then freezes the garbage
collector's view of those objects so that collections in the workers do not
touch (and so copy) the shared pages.
"""

import gc
import importlib
import os
import sys

from plumbing import lifeline, titles
from workers import formats, protocol


def _preload() -> None:
    lifeline.die_with_parent(expected_parent=None)
    titles.set_title("forkserver", os.environ.get(titles.RUNTIME_DIR_ENV, ""))
    # Workers compare their parent with this pid to close the race between
    # fork and their own parent-death signal.
    os.environ[lifeline.FORKSERVER_PID_ENV] = str(os.getpid())
    wanted = [m for m in os.environ.get(protocol.PRELOAD_ENV, "numpy").split(",") if m]
    # The format modules import their frameworks lazily, so they are cheap here.
    for name in [*wanted, "workers.loop", *(f.module for f in formats.FORMATS)]:
        try:
            importlib.import_module(name)
        except Exception as error:  # a broken optional framework must not stop the pool
            print(f"mesh-runtime forkserver: cannot preload {name}: {error}", file=sys.stderr)
    gc.collect()
    gc.freeze()


_preload()
