"""Handing freed heap back to the OS, in the front and in the workers.

glibc keeps the heap it frees mapped for later allocations, and the pod's
memory cgroup is charged for it until the process exits or calls
malloc_trim(). A worker trims after a load so that the front measures what
the model keeps; the front trims once a burst of unloads is over, or the
state it held for the workers it reaped (socket buffers, records, logs)
would stay charged to the pod.
"""

import ctypes


def trim() -> None:
    """malloc_trim(0): every arena's free pages back to the OS; nothing on a libc without it."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc
        pass
