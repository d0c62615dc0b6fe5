"""The front's open-file limit: raised to the hard limit at start, and checked against the workers.

The front holds a few descriptors for every worker it runs, so its open-file
limit caps how many workers it can run. The soft limit a container starts
with is often far below the hard one, and only the hard one is a real bound,
so the front raises the soft limit to it first. If even the hard limit cannot
hold the workers the front may be asked for, it says so once at start, naming
WORKERS_MAX. And the pool forks no worker that would leave the front short of
descriptors (`room_for_a_worker`): the load that needed it is refused instead.
"""

from __future__ import annotations

import logging
import os
import resource

from runtime import memory
from runtime.settings import Settings

log = logging.getLogger("mesh.filelimit")

# The front keeps four descriptors open per worker: its end of the worker's
# ZeroMQ ipc connection and of its call lane, the pipe multiprocessing reports
# the worker's exit on, and the write end multiprocessing keeps of the pipe it
# sent the worker's start data through.
DESCRIPTORS_PER_WORKER = 4

# The front's own descriptors, whatever the workers: grpc's and ZeroMQ's event
# descriptors and listening sockets, the fork server's pipes, the lock and log
# files; rounded up to leave room for model-mesh's connections and the files a
# load or a metrics scrape opens for a moment.
BASE_DESCRIPTORS = 64

# Kept free whatever the workers: the front opens /proc files to measure a
# load, accepts connections, and a worker's start that runs out of descriptors
# half-way takes the fork server down with every worker (docs/density.md).
RESERVED_DESCRIPTORS = 32

# The least a worker can cost (a forked worker's own pages before any model):
# with no WORKERS_MAX, the container's memory bounds the workers at its size
# divided by this.
WORKER_MEMORY_FLOOR_BYTES = 4 * 2**20

# With an unlimited hard limit the kernel still refuses a soft limit above
# nr_open; its default is the fallback where /proc cannot be read.
NR_OPEN_PATH = "/proc/sys/fs/nr_open"
DEFAULT_NR_OPEN = 1024 * 1024


def check_open_file_limit(settings: Settings) -> None:
    """Raises the soft limit to the hard one, and warns if that cannot hold the workers."""
    limit = raise_soft_limit()
    container_bytes = memory.container_memory(settings.container_mem_req_bytes)
    warning = shortfall_warning(limit, settings.workers_max, container_bytes)
    if warning is not None:
        log.warning("%s", warning)


def raise_soft_limit() -> int:
    """Sets RLIMIT_NOFILE's soft limit to its hard limit (made finite); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = max(soft, finite_limit(hard))
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as error:
        log.warning("cannot raise the open-file soft limit from %d to %d: %s", soft, target, error)
        return soft
    log.info("open-file soft limit: was %d, now %d (hard limit: %s)", soft, target, describe(hard))
    return target


def room_for_a_worker(workers: int, starting: int = 0) -> bool:
    """True while the front, running `workers` workers, can open another one and keep the reserve.
    `starting` of those are on their way, and may not have opened their descriptors yet."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return True
    # Counting /proc/self/fd takes milliseconds of the event loop at thousands of
    # descriptors: count only once an estimate puts the limit within a factor of two.
    estimate = BASE_DESCRIPTORS + DESCRIPTORS_PER_WORKER * (workers + 1) + RESERVED_DESCRIPTORS
    if 2 * estimate <= soft:
        return True
    return open_descriptors() + DESCRIPTORS_PER_WORKER * (starting + 1) + RESERVED_DESCRIPTORS <= soft


def open_descriptors() -> int:
    """How many descriptors this process holds open now."""
    return len(os.listdir("/proc/self/fd"))


def finite_limit(hard: int) -> int:
    """The hard limit, or the kernel's nr_open where it is unlimited (no soft limit may pass that)."""
    if hard != resource.RLIM_INFINITY:
        return hard
    try:
        with open(NR_OPEN_PATH) as nr_open:
            return int(nr_open.read())
    except (OSError, ValueError):
        return DEFAULT_NR_OPEN


def describe(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)


def workers_held(limit: int) -> int:
    """How many workers the front can run within an open-file limit."""
    return max(0, (limit - BASE_DESCRIPTORS) // DESCRIPTORS_PER_WORKER)


def workers_wanted(workers_max: int, container_bytes: int) -> int:
    """How many workers the front may be asked for: WORKERS_MAX, else as many as the memory could hold."""
    if workers_max > 0:
        return workers_max
    return container_bytes // WORKER_MEMORY_FLOOR_BYTES


def shortfall_warning(limit: int, workers_max: int, container_bytes: int) -> str | None:
    """The warning to log when `limit` cannot hold the workers wanted; None when it can."""
    held = workers_held(limit)
    wanted = workers_wanted(workers_max, container_bytes)
    if wanted <= held:
        return None
    if workers_max > 0:
        asked = f"WORKERS_MAX={workers_max} allows {wanted}"
    else:
        asked = (
            f"WORKERS_MAX=0 (no cap) lets the container's {container_bytes // 2**20} MiB hold up to {wanted}"
        )
    # WORKERS_MAX=0 means no cap, so it is no advice where not even one worker fits.
    cap = f"set WORKERS_MAX to {held} or less, or " if held > 0 else ""
    return (
        f"the front's open-file limit ({limit}) holds about {held} workers, but {asked}; "
        f"{cap}raise the hard limit (ulimit -n, or the container runtime's nofile)"
    )
