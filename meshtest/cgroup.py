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

V2_ROOT = "/sys/fs/cgroup"
_V1_MEMORY = "/sys/fs/cgroup/memory"


def v2_has(controller: str) -> bool:
    """Whether cgroup v2 is mounted at V2_ROOT with `controller` in it."""
    try:
        with open(os.path.join(V2_ROOT, "cgroup.controllers")) as controllers:
            return controller in controllers.read().split()
    except OSError:
        return False


def make(name: str, controller: str, v1_root: str) -> tuple[str | None, str]:
    """A new cgroup for one measured server: (its path, "v2" or "v1"), or (None, why not)."""
    leaf = f"mesh-bench-{os.getpid()}-{name}"
    why = []
    for root, version in ((V2_ROOT, "v2"), (v1_root, "v1")):
        if version == "v2" and not v2_has(controller):
            why.append(f"no cgroup v2 with {controller} at {V2_ROOT}")
            continue
        path = os.path.join(root, leaf)
        try:
            os.mkdir(path)
        except OSError as error:
            why.append(f"{path}: {error.strerror}")
            continue
        if os.path.exists(os.path.join(path, "cgroup.procs")):
            return path, version
        why.append(f"{root} holds no cgroup hierarchy")
        os.rmdir(path)
    return None, "; ".join(why)


class Cgroup:
    """A cgroup that a server's command joins (path None where none could be made)."""

    path: str | None = None

    def command_prefix(self) -> tuple[str, ...]:
        """Put in front of the server's command line: it joins the cgroup, then execs the server."""
        if self.path is None:
            return ()
        procs = shlex.quote(os.path.join(self.path, "cgroup.procs"))
        return ("sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh")

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


class Meter(Cgroup):
    """Measures one server's memory from outside: its cgroup's usage, else its tree's PSS."""

    def __init__(self, name: str):
        self.usage_file = ""
        self.method = "PSS sum of the process tree (no memory cgroup could be created: kernel share missed)"
        self.root_pid: int | None = None
        self.path, version = make(name, "memory", _V1_MEMORY)
        if self.path is not None:
            usage = "memory.current" if version == "v2" else "memory.usage_in_bytes"
            self.usage_file = os.path.join(self.path, usage)
            self.method = f"cgroup {version} {usage}"

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
