"""scripts/bench --cpu-limit: the front's busy polling inside a CPU quota of one core.

A pod with a CPU limit runs in a cgroup with a CFS quota: every thread of the
pod draws from one budget per period, so a front that spins while it waits
for a worker's reply takes CPU time from the very worker it waits for. This
runs mesh-runtime (the echo model, small requests) in a cgroup with a quota
of QUOTA_CORES (cgroup v2 `cpu.max`, else v1 `cpu.cfs_quota_us`; made as
root, skipped with a message where it cannot be), once with each of
BUSY_POLL_US=1000 (always polling), BUSY_POLL_US=0 and the default (off, as
BUSY_POLL_US=0; the runtime logs what it runs with), and drives each with
h2load at CONCURRENCY clients, in ROUNDS rounds whose order alternates.
Each point reports its median round: req/s, p50, p99 and server CPU per
call, side by side.
"""

from __future__ import annotations

import contextlib
import os
import tempfile

from bench.common import progress
from bench.h2load import Target, measure
from bench.installers import ensure_h2load
from bench.payloads import SMALL, expect_echo, mesh_header_lines, small_request
from bench.servers import RUNTIME_ENV, stop_runtime
from meshtest import cgroup, harness

QUOTA_CORES = 1.0
PERIOD_US = 100_000
CONCURRENCY = (1, 8, 16)
ROUNDS = 3
SETTINGS = {
    "BUSY_POLL_US=1000": {"BUSY_POLL_US": "1000"},
    "BUSY_POLL_US=0": {"BUSY_POLL_US": "0"},
    "default": {},
}

_V1_CPU = "/sys/fs/cgroup/cpu"


class CpuQuota(cgroup.Cgroup):
    """A cgroup whose processes share `cores` of CPU time; path None (and why_not) where none
    could be made."""

    def __init__(self, name: str, cores: float = QUOTA_CORES):
        self.path, version = cgroup.make(name, "cpu", _V1_CPU)
        self.why_not = "" if self.path is not None else version
        if self.path is None:
            return
        quota = int(cores * PERIOD_US)
        try:
            if version == "v2":
                self._write("cpu.max", f"{quota} {PERIOD_US}")
            else:
                self._write("cpu.cfs_period_us", str(PERIOD_US))
                self._write("cpu.cfs_quota_us", str(quota))
        except OSError as error:
            self.why_not = f"{self.path}: {error}"
            self.remove()
            self.path = None

    def _write(self, name: str, value: str) -> None:
        assert self.path is not None
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)


def resolved_busy_poll(rt: harness.Runtime) -> str:
    """What the runtime's log says it runs with for busy polling."""
    for line in rt.log().splitlines():
        if "busy polling" in line:
            return line.split("busy polling", 1)[1].strip(" :")
    return "(not logged)"


def run(duration: float = 8.0, warmup: float = 1.0, rounds: int = ROUNDS) -> dict:
    figures: dict = {"quota_cores": QUOTA_CORES, "rounds": rounds, "points": [], "resolved": {}}
    folder = tempfile.mkdtemp(prefix="mr-cpulimit-")
    with contextlib.ExitStack() as stack:
        quotas = {}
        for name in SETTINGS:
            quotas[name] = CpuQuota(name.replace("=", "-"))
            stack.callback(quotas[name].remove)
        missing = [q.why_not for q in quotas.values() if q.path is None]
        if missing:
            figures["skipped"] = f"no CPU cgroup could be made ({missing[0]})"
            return figures
        figures["h2load"] = ensure_h2load()
        targets = {}
        for name, env in SETTINGS.items():
            rt = harness.Runtime(command_prefix=quotas[name].command_prefix(), **{**RUNTIME_ENV, **env})
            stack.callback(stop_runtime, rt)
            progress(f"cpu limit: starting mesh-runtime with {name} in {QUOTA_CORES:g} core of quota")
            rt.start()
            rt.load("echo", rt.model_dir("echo"))
            figures["resolved"][name] = resolved_busy_poll(rt)
            targets[name] = Target(
                f"echo, {name}",
                SMALL,
                rt.port,
                small_request("echo"),
                mesh_header_lines("echo"),
                expect_echo(False),
                lambda rt=rt: harness.tree(rt.pid),
                folder,
            )
        rounds_of: dict[tuple[str, int], list[dict]] = {}
        for round_number in range(rounds):
            order = list(targets) if round_number % 2 == 0 else list(reversed(targets))
            for concurrency in CONCURRENCY:
                for name in order:
                    progress(f"cpu limit: round {round_number + 1}, {name}, {concurrency} clients")
                    point = measure(targets[name], concurrency, duration, warmup, folder)
                    rounds_of.setdefault((name, concurrency), []).append(point)
        for (name, _), points in rounds_of.items():
            median = sorted(points, key=lambda p: p["req_s"])[(len(points) - 1) // 2]  # the lower one of two
            median["setting"] = name
            median["rounds_req_s"] = [p["req_s"] for p in points]
            figures["points"].append(median)
    return figures


def print_report(figures: dict) -> None:
    if "skipped" in figures:
        print(f"cpu limit: skipped: {figures['skipped']}")
        return
    print(
        f"\nechoes under a CPU quota of {figures['quota_cores']:g} core, median of {figures['rounds']} "
        "rounds (alternating order)"
    )
    for name, resolved in figures["resolved"].items():
        print(f"  {name}: the runtime runs with {resolved}")
    header = (
        f"  {'setting':<18} {'c':>3} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'CPU per call':>13}  rounds"
    )
    print(header)
    for p in sorted(figures["points"], key=lambda p: (p["concurrency"], p["setting"])):
        rounds = ", ".join(f"{r:,.0f}" for r in p["rounds_req_s"])
        print(
            f"  {p['setting']:<18} {p['concurrency']:>3} {p['req_s']:>8,.0f} {p['p50_ms']:>8.3f} "
            f"{p['p99_ms']:>8.3f} {p['server_cpu_us_per_req']:>10.0f} µs  {rounds}"
        )
    for concurrency in CONCURRENCY:
        by = {p["setting"]: p for p in figures["points"] if p["concurrency"] == concurrency}
        polling, sleeping, default = (by.get(k) for k in SETTINGS)
        if default and sleeping:
            ratio = default["req_s"] / sleeping["req_s"]
            p99 = default["p99_ms"] / sleeping["p99_ms"]
            if figures["resolved"].get("default") == "off":  # the same setting: no target to judge
                verdict = "(the default is off, as BUSY_POLL_US=0: the ratio is the rounds' noise)"
            else:
                verdict = "(target: no loss beyond noise, >= 0.95 and <= 1.10) " + (
                    "PASS" if ratio >= 0.95 and p99 <= 1.10 else "MISS"
                )
            print(f"  c={concurrency}: default / BUSY_POLL_US=0: req/s {ratio:.2f}, p99 {p99:.2f} {verdict}")
        if polling and sleeping:
            print(
                f"  c={concurrency}: BUSY_POLL_US=1000 / 0: req/s {polling['req_s'] / sleeping['req_s']:.2f}"
            )
