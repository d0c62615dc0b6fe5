"""Handing freed heap back to the OS, and keeping big buffers mapped while calls flow.

glibc keeps the heap it frees mapped for later allocations, and the pod's
memory cgroup is charged for it until the process exits or calls
malloc_trim(). A worker trims after a load so that the front measures what
the model keeps; the front trims once a burst of unloads is over, or the
state it held for the workers it reaped (socket buffers, records, logs)
would stay charged to the pod.

Big buffers are the other way round. By default glibc serves each buffer
above its (moving) mmap threshold with a fresh mapping and unmaps it on
free, and gives the top of the heap back whenever it passes twice that
threshold: every tensor of a MiB or more then costs a page fault per 4 KiB
page, in each process it crosses, on every call. keep_big_buffers() fixes
the thresholds, so such buffers come from the heap and their pages stay
for the next call, and limits the process to one malloc arena, because
malloc_trim() can shrink only the main arena's top: what the calls left is
then all given back by the trim that follows them once they stop
(TRIM_AFTER_BYTES, runtime/heaptrim.py and workers/loop.py).
"""

import ctypes

# glibc's mallopt() parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
# Buffers up to this size come from the heap (glibc's ceiling for its moving threshold is 32 MiB).
HEAP_BUFFERS_UP_TO = 8 * 2**20
# Free heap a process keeps at its top between calls, enough for many such buffers in flight at once.
KEEP_FREE_UP_TO = 16 * 2**20
# A call that moved a buffer this big (glibc's default mmap threshold, which used to map
# it afresh) may have left free heap behind: the process trims once its calls stop.
TRIM_AFTER_BYTES = 128 * 2**10


def trim() -> None:
    """malloc_trim(0): every arena's free pages back to the OS; nothing on a libc without it."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc
        pass


def keep_big_buffers() -> bool:
    """Fixes this process's malloc thresholds and its arena to one (see above); call before threads start.

    Forked children inherit the settings. False where the libc has no mallopt() or refused one.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:  # not glibc
        return False
    settings = (
        (_M_ARENA_MAX, 1),
        (_M_MMAP_THRESHOLD, HEAP_BUFFERS_UP_TO),
        (_M_TRIM_THRESHOLD, KEEP_FREE_UP_TO),
    )
    return all(mallopt(parameter, value) == 1 for parameter, value in settings)
