"""Memory facts the runtime reports: what a process costs the pod, and the pod's capacity.

What the OS gets back when a worker dies, which is exactly what unloading its
model frees, is two things. Its unique pages (USS), read from
/proc/PID/smaps_rollup, which the kernel sums for us (what psutil's
memory_full_info().uss adds up from /proc/PID/smaps, at a fraction of the
cost; psutil is the fallback on a kernel without smaps_rollup). And the
kernel's own share for the process, which the pod's memory cgroup is charged
for but no page count shows: its page tables (VmPTE: a forked worker maps
every region of the fork server, so they are not small), a kernel stack per
thread, a few hundred bytes per mapping (the region's descriptor and its
reverse-map links) and the process's own descriptors. `cost()` is the sum:
the size we report for a model, so that model-mesh never packs more models
into the pod than it holds.

The processes we measure may exit while we read their /proc files, and the
kernel then answers ESRCH (exiting, or a zombie), ENOENT (reaped) or EACCES
(the pid now belongs to someone else). Every reader here turns those into one
contract: psutil.NoSuchProcess for a process that is gone, psutil.AccessDenied
for one that is not ours; callers catch psutil.Error.
"""

from __future__ import annotations

import os

import psutil

from plumbing import lifeline

_PRIVATE_FIELDS = (b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:")

# The kernel's share beyond page tables, per thread, per mapping and per process.
# THREAD_SIZE is 16 KiB on x86_64 and arm64. The other two were fitted to what a
# memory cgroup was charged per worker (kmem) for workers with few and with many
# mappings, and rounded up: docs/density.md has the method and the figures.
KERNEL_STACK_BYTES = 16 * 1024
MAPPING_BYTES = 384
PROCESS_BYTES = 64 * 1024
# What the front holds for each worker it runs (its end of the worker's socket
# and pipes, their buffers, its records of the worker): charged to the model the
# worker serves, and so left out of the front's own cost in overhead().
FRONT_SHARE_BYTES = 64 * 1024
# What the front holds for each model, whichever worker serves it (its records,
# its metrics' series, its replica set): in FRONT_SHARE_BYTES for a model with
# a worker of its own, charged on top to each model in a pack.
FRONT_MODEL_BYTES = 8 * 1024

# cgroup v2, then v1: the container's memory limit when one is set.
_CGROUP_LIMIT_FILES = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


# smaps_rollup exists since Linux 4.14; only without it do we ask psutil.
_HAS_ROLLUP = os.path.exists("/proc/self/smaps_rollup")


def _proc_file(pid: int, name: str) -> bytes:
    """/proc/PID/NAME, with the errors of a process that is gone or not ours made psutil's."""
    try:
        with open(f"/proc/{pid}/{name}", "rb") as proc_file:
            return proc_file.read()
    except (ProcessLookupError, FileNotFoundError):
        raise psutil.NoSuchProcess(pid) from None
    except PermissionError:
        raise psutil.AccessDenied(pid) from None


def _rollup(pid: int, fields: tuple[bytes, ...]) -> int:
    """The sum of `fields` in /proc/PID/smaps_rollup, in bytes."""
    lines = _proc_file(pid, "smaps_rollup").splitlines()
    return 1024 * sum(int(line.split()[1]) for line in lines if line.startswith(fields))


def uss(pid: int) -> int:
    """Unique memory of process `pid` in bytes; raises psutil.Error if it is gone or not ours."""
    if _HAS_ROLLUP:
        return _rollup(pid, _PRIVATE_FIELDS)
    return psutil.Process(pid).memory_full_info().uss


def kernel_share(pid: int) -> int:
    """Bytes the kernel holds for process `pid` itself: page tables, stacks, mappings, descriptors.

    Raises psutil.Error if it is gone or not ours.
    """
    page_tables, threads = None, 1
    for line in _proc_file(pid, "status").splitlines():
        if line.startswith(b"VmPTE:"):
            page_tables = 1024 * int(line.split()[1])
        elif line.startswith(b"Threads:"):
            threads = int(line.split()[1])
    if page_tables is None:  # a zombie: its memory, page tables and all, is already freed
        raise psutil.NoSuchProcess(pid)
    mappings = _proc_file(pid, "maps").count(b"\n")
    return page_tables + threads * KERNEL_STACK_BYTES + mappings * MAPPING_BYTES + PROCESS_BYTES


def cost(pid: int) -> int:
    """What the pod gets back when process `pid` exits: uss() plus kernel_share().

    Raises psutil.Error if it is gone or not ours.
    """
    return uss(pid) + kernel_share(pid)


def anonymous(pid: int | None) -> int:
    """Anonymous resident bytes and page tables of process `pid` (0 if it is gone or not started).

    What a load into a pack adds and a drop gives back is heap: this sees it
    as cost() does, from /proc/PID/status alone, whose counters the kernel
    keeps: microseconds, and no lock the process holds, so the event loop
    may read it, where cost() walks every mapping. It does not see pages
    copied from the fork server on write, which a drop never gives back, so
    it serves for differences between two moments, not for sizes.
    """
    if pid is None:
        return 0
    try:
        status = _proc_file(pid, "status")
    except psutil.Error:
        return 0
    fields = (b"RssAnon:", b"VmPTE:")
    return 1024 * sum(int(line.split()[1]) for line in status.splitlines() if line.startswith(fields))


def cost_or_zero(pid: int | None) -> int:
    """What the pod gets back when process `pid` ends with every process below it (what its
    models started, which end with it), by their unique pages: cost() of each, or 0 for a process
    that is gone, not ours or not started: none of our memory is in it.

    What a pack is measured by: its own cost does not move as other workers come and go (a load
    that leaves a process below it is charged at least the pack's anonymous growth instead:
    runtime/packs.py). A worker of one model is measured by tree_cost() (serving_cost()).
    """
    if pid is None:
        return 0
    try:
        total = cost(pid)
    except psutil.Error:
        return 0
    for each in lifeline.descendants(pid):
        try:
            total += cost(each)
        except psutil.Error:
            pass  # it ended meanwhile, or is a zombie: its memory is back already
    return total


def tree_cost_or_zero(pid: int | None) -> int:
    """tree_cost(), or 0 for a process that is gone, not ours or not started."""
    if pid is None:
        return 0
    try:
        return tree_cost(pid)
    except psutil.Error:
        return 0


def tree_cost(pid: int) -> int:
    """cost() of process `pid` and of every process below it; by their proportional shares where
    a process below it shares pages (it was forked, not executed, or maps shared memory).

    A child the model forked shares the worker's pages until one of them writes
    to them: those pages are in neither one's unique pages, so a sum of cost()
    would miss them. Summed over the tree, PSS counts each page the tree alone
    maps once; it also counts the tree's share of the pages it shares with the
    fork server, which that server's own count already holds: an over-count,
    never an under-count. Shared memory two of them map (multiprocessing's
    shared_memory, say) is in neither's unique pages either. An executed program
    (subprocess) that maps no shared memory shares no page but libraries', so
    where only such run below, cost() of each counts them exactly.
    Raises psutil.Error if `pid` is gone or not ours; a process below it that
    has ended is skipped.
    """
    below = []
    for each in lifeline.descendants(pid):
        try:
            below.append((_rollup_fields(each), kernel_share(each)))
        except psutil.Error:
            pass  # it ended meanwhile, or is a zombie: its memory is back already
    if not below:
        return cost(pid)
    if not any(_shares_pages(fields) for fields, _ in below):
        return cost(pid) + sum(fields["unique"] + share for fields, share in below)
    return (
        proportional(pid) + kernel_share(pid) + sum(fields["proportional"] + share for fields, share in below)
    )


def proportional(pid: int) -> int:
    """Process `pid`'s proportional set size (PSS): each page it maps divided by how many map it."""
    if _HAS_ROLLUP:
        return _rollup(pid, (b"Pss:",))
    return psutil.Process(pid).memory_full_info().pss


def _rollup_fields(pid: int) -> dict[str, int]:
    """Process `pid`'s unique and proportional bytes, its anonymous ones in all and in proportion,
    and its shared memory in proportion (left out where the kernel does not tell), from one read."""
    if not _HAS_ROLLUP:
        info = psutil.Process(pid).memory_full_info()
        return {"unique": info.uss, "proportional": info.pss}
    fields: dict[str, int] = {"unique": 0}
    for line in _proc_file(pid, "smaps_rollup").splitlines():
        name, _, rest = line.partition(b":")
        if name in (b"Private_Clean", b"Private_Dirty", b"Private_Hugetlb"):
            fields["unique"] += 1024 * int(rest.split()[0])
        elif name in _ROLLUP_NAMES:
            fields[_ROLLUP_NAMES[name]] = 1024 * int(rest.split()[0])
    return fields


_ROLLUP_NAMES = {
    b"Pss": "proportional",
    b"Anonymous": "anonymous",
    b"Pss_Anon": "anonymous_share",
    b"Pss_Shmem": "shared_memory",
}


def _shares_pages(fields: dict[str, int]) -> bool:
    """Whether the process maps shared memory, or an anonymous page another maps too (true where
    the kernel does not tell)."""
    if not {"anonymous", "anonymous_share", "shared_memory"} <= fields.keys():
        return True
    return fields["shared_memory"] > 0 or fields["anonymous_share"] < fields["anonymous"]


def serving_cost(pid: int | None, first_calls: int) -> int:
    """What the model worker `pid` costs the pod: tree_cost(), its share of the front, and
    `first_calls` bytes (0 once it has served a call: its format's first_calls_bytes
    until then, so that a size measured at load already covers them).

    0 for a process that is gone, not ours or not started.
    """
    measured = tree_cost_or_zero(pid)
    return measured + FRONT_SHARE_BYTES + first_calls if measured else 0


def serving_costs(workers: list[tuple[int | None, int]]) -> list[int]:
    """serving_cost() of each (pid, first_calls); blocking, so run it in a thread."""
    return [serving_cost(pid, first_calls) for pid, first_calls in workers]


def uss_each(pids: list[int | None]) -> list[int]:
    """The unique memory of each pid, 0 for one that is gone; blocking, so run it in a thread."""
    sizes = []
    for pid in pids:
        try:
            sizes.append(0 if pid is None else uss(pid))
        except psutil.Error:
            sizes.append(0)
    return sizes


def cgroup_limit() -> int | None:
    """The memory limit of our cgroup, or None when there is none."""
    for path in _CGROUP_LIMIT_FILES:
        try:
            with open(path) as limit_file:
                text = limit_file.read().strip()
        except OSError:
            continue
        if text == "max":
            return None
        limit = int(text)
        # cgroup v1 reports "no limit" as a huge page-aligned number.
        if limit >= psutil.virtual_memory().total:
            return None
        return limit
    return None


def container_memory(configured: int | None) -> int:
    """Memory the runtime may use: CONTAINER_MEM_REQ_BYTES, else the cgroup limit, else RAM."""
    if configured:
        return configured
    return cgroup_limit() or psutil.virtual_memory().total


def overhead(model_pids: set[int]) -> int:
    """What this process and its descendants cost the pod, the model workers in `model_pids` and
    every process below them (in their models' sizes) aside.

    The front, the resource tracker and the spares are counted by cost(). A
    process that has children of its own (the fork server) is counted by all
    its resident pages instead: every one of them is in memory once, and a
    worker's unique pages never include those it still shares with it. So
    this plus the models' serving_cost() counts each page of the tree once.

    A descendant that ends while we count is skipped; blocking, so run it in a thread.
    """
    front = psutil.Process()
    total = max(0, cost(front.pid) - FRONT_SHARE_BYTES * len(model_pids))
    descendants = front.children(recursive=True)  # one walk of /proc, not one per process
    parent_of = {}
    for process in descendants:
        try:
            parent_of[process.pid] = process.ppid()
        except psutil.Error:
            pass
    parents = set(parent_of.values())
    for process in descendants:
        if _in_models(process.pid, model_pids, parent_of):
            continue
        try:
            if process.pid in parents:
                total += resident(process.pid) + kernel_share(process.pid)
            else:
                total += cost(process.pid)
        except psutil.Error:
            pass
    return total


def _in_models(pid: int, model_pids: set[int], parent_of: dict[int, int]) -> bool:
    """Whether `pid` is a model worker or runs below one (parent_of: each descendant's parent)."""
    current: int | None = pid
    for _ in range(len(parent_of) + 1):  # a pid reused while we read could make a loop
        if current is None:
            return False
        if current in model_pids:
            return True
        current = parent_of.get(current)
    return False


def unclaimed(packs: list[tuple[int | None, int]]) -> int:
    """What packs cost beyond what their models are charged: their base and later growth.

    `packs`: (pid, bytes its models are charged) of each (runtime/packs.py). Blocking.
    """
    return sum(max(0, serving_cost(pid, 0) - charged) for pid, charged in packs)


def resident(pid: int) -> int:
    """All the pages process `pid` has in memory, shared or not; raises psutil.Error if it is gone."""
    if _HAS_ROLLUP:
        return _rollup(pid, (b"Rss:",))
    return psutil.Process(pid).memory_info().rss
