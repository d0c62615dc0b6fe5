"""Where the limits this process runs under are written: its cgroup's folder for a controller, and
the folders above it.

A container's CPU quota, task limit and memory's OOM kills are files in its
cgroup's folder, or in one above it (a pod's), where the container can see
that far. /proc/self/cgroup names the folder: cgroup v2 has one hierarchy
for every controller (its line reads `0::/path`); v1 has one per
controller, mounted under its controllers' names (`cpu,cpuacct`, or linked
as `cpu`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import NamedTuple, TypeVar

CGROUP_ROOT = "/sys/fs/cgroup"
SELF_CGROUP = "/proc/self/cgroup"
Found = TypeVar("Found")


class Membership(NamedTuple):
    folder: str  # this process's cgroup in one hierarchy
    top: str  # that hierarchy's root
    v2: bool


def memberships(
    controller: str, cgroup_root: str = CGROUP_ROOT, self_cgroup: str = SELF_CGROUP
) -> list[Membership]:
    """This process's cgroup in each hierarchy that may hold `controller`'s files: v2's, and v1's of
    that controller; none where self_cgroup cannot be read."""
    try:
        with open(self_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:  # not a cgroup line: nothing to learn from it
            continue
        _, controllers, path = fields
        if controllers == "":
            top = cgroup_root
        elif controller in controllers.split(","):
            top = os.path.join(cgroup_root, controllers)
            if not os.path.isdir(top):
                top = os.path.join(cgroup_root, controller)
        else:
            continue
        found.append(Membership(os.path.join(top, path.lstrip("/")), top, controllers == ""))
    return found


def read_up(member: Membership, read: Callable[[str], Found | None]) -> list[Found]:
    """What read() finds in the cgroup's folder and in each folder above it up to its root."""
    found = []
    folder = member.folder
    while True:
        value = read(folder)
        if value is not None:
            found.append(value)
        if os.path.normpath(folder) == os.path.normpath(member.top) or len(folder) <= len(member.top):
            return found
        folder = os.path.dirname(folder)
