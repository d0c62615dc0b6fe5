"""A memory cgroup of its own for one measured server: the pod's view of its memory.

A cgroup's usage is what a pod is charged for and killed by: every page the
server's processes touch, plus the kernel's share for them (page tables,
kernel stacks, socket buffers), which no /proc figure of a process shows.
As root we create one (cgroup v2 where it is mounted with the memory
controller, else v1 under /sys/fs/cgroup/memory) and start the server in
it. Where we cannot, the fallback is the PSS summed over the server's process
tree, which misses the kernel's share; `Meter.method` says which one measured.
"""

from __future__ import annotations

import os
import shlex
import time

import psutil

from meshtest import harness

_V2_ROOT = "/sys/fs/cgroup"
_V1_ROOT = "/sys/fs/cgroup/memory"


def _v2_usable() -> bool:
    try:
        with open(os.path.join(_V2_ROOT, "cgroup.controllers")) as controllers:
            return "memory" in controllers.read().split()
    except OSError:
        return False


class Meter:
    """Measures one server's memory from outside: its cgroup's usage, else its tree's PSS."""

    def __init__(self, name: str):
        self.path: str | None = None
        self.usage_file = ""
        self.method = "PSS sum of the process tree (no memory cgroup could be created: kernel share missed)"
        self.root_pid: int | None = None
        leaf = f"mesh-bench-{os.getpid()}-{name}"
        for root, usage, label in (
            (_V2_ROOT, "memory.current", "cgroup v2 memory.current"),
            (_V1_ROOT, "memory.usage_in_bytes", "cgroup v1 memory.usage_in_bytes"),
        ):
            if root == _V2_ROOT and not _v2_usable():
                continue
            path = os.path.join(root, leaf)
            try:
                os.mkdir(path)
            except OSError:
                continue
            if os.path.exists(os.path.join(path, usage)):
                self.path, self.usage_file, self.method = path, os.path.join(path, usage), label
                return
            os.rmdir(path)

    def command_prefix(self) -> tuple[str, ...]:
        """Put in front of the server's command line: it joins the cgroup, then execs the server."""
        if self.path is None:
            return ()
        procs = shlex.quote(os.path.join(self.path, "cgroup.procs"))
        return ("sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh")

    def usage(self) -> int:
        """Bytes in use now: the cgroup's counter, or the PSS sum of root_pid's tree."""
        if self.path is not None:
            with open(self.usage_file) as counter:
                return int(counter.read())
        assert self.root_pid is not None, "set root_pid before reading a PSS fallback"
        total = 0
        for process in harness.tree(self.root_pid):
            try:
                total += process.memory_full_info().pss
            except psutil.Error:
                pass
        return total

    def page_cache(self) -> int | None:
        """Bytes of the usage that are page cache (file pages: reclaimable when clean, so the kernel
        takes them back before it kills anything); None without a cgroup."""
        if self.path is None:
            return None
        key = "file" if self.usage_file.endswith("memory.current") else "cache"  # v2, v1
        with open(os.path.join(self.path, "memory.stat")) as stat:
            for line in stat:
                name, value = line.split()
                if name == key:
                    return int(value)
        return None

    def settled_usage(self, timeout: float = 30.0, tolerance: int = 1024 * 1024) -> int:
        """usage() once two readings a second apart agree within `tolerance` bytes."""
        deadline = time.monotonic() + timeout
        previous = self.usage()
        while True:
            time.sleep(1.0)
            now = self.usage()
            if abs(now - previous) <= tolerance or time.monotonic() > deadline:
                return now
            previous = now

    def remove(self) -> None:
        """Removes the cgroup once its processes are gone (a pod's memory is reparented, not lost)."""
        if self.path is None:
            return
        deadline = time.monotonic() + 10
        while True:
            try:
                os.rmdir(self.path)
                return
            except OSError:
                if time.monotonic() > deadline:
                    print(f"warning: could not remove the cgroup {self.path}")
                    return
                time.sleep(0.2)
