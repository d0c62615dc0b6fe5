"""Imported once inside the fork server, before it forks any worker.

multiprocessing's fork server imports its preload list at start; this module
is that list's only entry. It ties the fork server's life to the front's
(parent-death signal), sizes the frameworks' thread pools, imports its share
of WORKER_PRELOAD (the modules that are not frameworks, plus its own
framework: runtime/forkserver.py) and the worker's own code so that a new worker starts
in milliseconds, warms each imported format (workers/formats/warming.py) so
that a worker's first load and call find it done, runs the frameworks' first
tensor ops in a throwaway child (their code's page cache), fills the holes in its
malloc heap, then freezes the garbage collector's view of those objects so
that collections in the workers do not touch (and so copy) the shared pages.
"""

import ctypes
import errno
import gc
import importlib
import os
import sys
import threading

from plumbing import heap, lifeline, logsetup, titles
from workers import formats, protocol
from workers.formats import warming


def _preload() -> None:
    # A process group of its own: a signal to the front's group (a terminal's hang-up, `kill --
    # -PGID`, a service manager stopping the group) reaches the front alone, which then stops the
    # fork servers, or whose death does; killed beside the front, they could end nothing below them.
    os.setpgid(0, 0)
    # Its workers die with it; what their models started is ended by it as it goes.
    lifeline.end_everything_below_with_parent()
    heap.keep_big_buffers()  # before a framework starts a thread; every worker inherits it
    group = os.environ.get(protocol.FORKSERVER_GROUP_ENV, "base")
    titles.set_title(f"forkserver {group}", os.environ.get(titles.RUNTIME_DIR_ENV, ""))
    # Workers compare their parent with this pid to close the race between
    # fork and their own parent-death signal.
    os.environ[lifeline.FORKSERVER_PID_ENV] = str(os.getpid())
    # The workers' log level, set once here: set in each worker, it would copy
    # the page of every logger the frameworks make (plumbing/logsetup.py).
    logsetup.setup_from_env("worker")
    warming.limit_thread_pools()  # before the frameworks read it, at their import
    wanted = [m for m in os.environ.get(protocol.PRELOAD_ENV, "numpy").split(",") if m]
    # The format modules import their frameworks lazily, so they are cheap here.
    for name in [*wanted, "workers.main", "workers.loop", *(f.module for f in formats.FORMATS)]:
        threads = threading.active_count()
        try:
            importlib.import_module(name)
        except Exception as error:  # a broken optional framework must not stop the pool
            print(f"mesh-runtime forkserver: cannot preload {name}: {error}", file=sys.stderr)
        if threading.active_count() > threads:
            print(f"mesh-runtime forkserver: {_STARTED_A_THREAD.format(name)}", file=sys.stderr)
    warming.warm_imported()
    warming.touch_compute_code_in_a_child()
    gc.collect()
    _fill_heap_holes()
    gc.freeze()
    _keep_serving_when_a_fork_fails()


def _keep_serving_when_a_fork_fails() -> None:
    """A fork the kernel refuses (EAGAIN at the pids cgroup's pids.max or RLIMIT_NPROC, ENOMEM)
    must not end the fork server: multiprocessing's loop re-raises it and exits, and every worker
    it forked dies with it. Its loop goes on past an ECONNABORTED instead; the request's
    descriptors, closed here, tell the front that no worker came (EOF), and the front's start of
    the worker fails alone. Where the loop does not hold them under these names, the error stands.
    """
    real_fork = os.fork

    def fork() -> int:
        try:
            pid = real_fork()
        except OSError as error:
            request = sys._getframe(1).f_locals  # multiprocessing.forkserver.main's
            if error.errno not in (errno.EAGAIN, errno.ENOMEM) or not _REQUEST_FDS <= request.keys():
                raise
            for fd in (request["child_r"], request["child_w"], *request["fds"]):
                os.close(fd)
            print(f"mesh-runtime forkserver: cannot fork a worker: {error}", file=sys.stderr, flush=True)
            raise OSError(errno.ECONNABORTED, "the fork failed") from error
        if pid == 0:
            os.fork = real_fork  # a worker's own forks are its models'
        return pid

    os.fork = fork


_REQUEST_FDS = {"child_r", "child_w", "fds"}
# A Python thread a preloaded module starts (a thread pool, a background flusher) is missing in every
# worker, where a call that waits on it hangs. Only Python threads are counted: the frameworks' native
# ones are the warm-ups' concern (docs/warming.md), and onnxruntime's import starts one that none misses.
_STARTED_A_THREAD = (
    "importing {} started a thread, which no worker forked from here runs: a worker that waits on it "
    "hangs; take it out of WORKER_PRELOAD"
)


class _Mallinfo2(ctypes.Structure):
    """glibc's struct mallinfo2: fordblks is the free bytes, keepcost those at the heap's top."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def _fill_heap_holes() -> None:
    """Allocates, and keeps for good, the free chunks inside the fork server's malloc heap.

    Importing and warming leave freed chunks scattered among the objects that
    stay. A worker's mallocs would take those first, and each one it writes to
    copies the shared page around it: a few hundred KiB of holes spread over
    hundreds of pages, 0.5-1.5 MiB per worker. Filled, they leave a worker's
    allocations to the heap's end, on pages of its own from the start.
    glibc only; elsewhere this does nothing.
    """
    libc = ctypes.CDLL(None)
    mallinfo2 = getattr(libc, "mallinfo2", None)
    if mallinfo2 is None:
        return
    mallinfo2.restype = _Mallinfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    libc.sbrk.restype, libc.sbrk.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t]
    info = mallinfo2()
    # Free bytes inside the heap, plus room for malloc's per-thread cache, which
    # mallinfo counts as used: the bound only guards against a heap not laid out
    # by sbrk, where telling a hole from the heap's end below would fail.
    left = info.fordblks - info.keepcost + 1024 * 1024
    size = 128 * 1024
    while size >= 16 and left > 0:
        heap_end = libc.sbrk(0) - mallinfo2().keepcost  # where the unused top of the heap begins
        chunk = libc.malloc(size)
        if chunk and chunk < heap_end:
            left -= size  # a hole: kept
        else:
            libc.free(chunk)
            size = size * 3 // 4 if size > 64 else size - 16


_preload()
