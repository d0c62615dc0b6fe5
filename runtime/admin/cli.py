"""The operators' commands: inspect-workers, worker-stacks, kill-worker.

They talk to a running front over its admin socket (runtime/admin). The
socket is found in RUNTIME_DIR, which they compute from the environment the
same way the runtime does (or take from --runtime-dir). When the socket does
not answer, inspect-workers falls back on finding workers by their process
titles with psutil, and says so.

Exit codes: 0 healthy / done, 1 a model is degraded or the command was
refused, 2 the runtime could not be reached.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import psutil
import zmq

from plumbing import titles
from runtime.admin import socket_path
from runtime.settings import Settings, SettingsError

TIMEOUT_MS = 3000
COLUMNS = [
    ("pid", 7),
    ("role", 5),
    ("model", 28),
    ("state", 9),
    ("uptime", 8),
    ("uss", 9),
    ("rss", 9),
    ("cpu%", 6),
    ("inflight", 8),
    ("served", 8),
    ("errors", 6),
    ("last_error", 0),
]
OK, DEGRADED, UNREACHABLE = 0, 1, 2


class Unreachable(Exception):
    pass


class Refused(Exception):
    pass


def ask(runtime_dir: str, command: str, *args: str) -> object:
    path = socket_path(runtime_dir)
    if not os.path.exists(path):
        raise Unreachable(f"no admin socket at {path}")
    context = zmq.Context()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sock.setsockopt(zmq.SNDTIMEO, TIMEOUT_MS)
    try:
        sock.connect(f"ipc://{path}")
        sock.send(json.dumps({"command": command, "args": list(args)}).encode())
        answer = json.loads(sock.recv())
    except zmq.Again:
        raise Unreachable(f"the admin socket at {path} did not answer within {TIMEOUT_MS} ms") from None
    finally:
        sock.close()
        context.term()
    if not answer.get("ok"):
        raise Refused(answer.get("error", "refused"))
    return answer["result"]


def _ask_list(runtime_dir: str, command: str) -> list[dict]:
    """ask() for a command the front answers with a list of rows ("workers", "models")."""
    result = ask(runtime_dir, command)
    if not isinstance(result, list):
        raise TypeError(f"the front answered {command!r} with {type(result).__name__}, not a list")
    return result


def _runtime_dir(given: str | None) -> str:
    if given:
        return os.path.abspath(given)  # as the front reads RUNTIME_DIR: normalised, its titles too
    try:
        return Settings.from_env().runtime_dir
    except SettingsError as error:
        sys.exit(f"{error}")


def _mib(value: int) -> str:
    return f"{value / 2**20:.1f}M" if value else "-"


def _cells(row: dict) -> list[str]:
    return [
        str(row["pid"]),
        row["role"],
        row["model"] or "-",
        row["state"],
        f"{row['uptime_s']:.0f}s",
        _mib(row["uss_bytes"]),
        _mib(row["rss_bytes"]),
        f"{row['cpu_percent']:.1f}",
        str(row["in_flight"]),
        str(row["served"]),
        str(row["errors"]),
        (row["last_error"] or "-").replace("\n", " ")[:120],
    ]


def table(rows: list[dict]) -> str:
    lines = [" ".join(name.upper().ljust(width) for name, width in COLUMNS).rstrip()]
    for row in rows:
        cells = zip(_cells(row), COLUMNS, strict=True)
        lines.append(" ".join(cell.ljust(width) for cell, (_, width) in cells).rstrip())
        for member in row.get("models", []):  # a pack's models, under it
            slow = " (its load ran long)" if member.get("loads_slowly") else ""
            lines.append(f"{'':{COLUMNS[0][1]}}   - {member['model']} {_mib(member['bytes'])}{slow}")
    return "\n".join(lines)


def role_in_title(cmdline: list[str], runtime_dir: str) -> tuple[str, str] | None:
    """(role, model) of a worker or pack of runtime_dir from its title: ("model", its id),
    ("spare", ""), ("pack", "models=N"); None for any other process."""
    if not titles.is_runtime_process_of(cmdline, runtime_dir):
        return None
    text = " ".join(part for part in cmdline if part)
    role = text[len(titles.TITLE_PREFIX) : -len(f" dir={runtime_dir}")]
    for prefix, kind in (("worker model=", "model"), ("worker spare", "spare"), ("pack ", "pack")):
        if role.startswith(prefix):
            return kind, role[len(prefix) :]
    return None  # the front, a fork server


def rows_from_titles(runtime_dir: str) -> list[dict]:
    """Degraded mode: the runtime's workers and packs, found by process title (what psutil can tell
    without the front)."""
    rows = []
    for process in psutil.process_iter(["pid", "cmdline", "create_time"]):
        found = role_in_title(process.info["cmdline"] or [], runtime_dir)
        if found is None:
            continue
        role, model = found
        try:
            uss, rss = process.memory_full_info().uss, process.memory_info().rss
        except psutil.Error:
            uss = rss = 0
        rows.append(
            {
                "pid": process.info["pid"],
                "role": role,
                "model": model,
                "state": "?",
                "uptime_s": time.time() - process.info["create_time"],
                "uss_bytes": uss,
                "rss_bytes": rss,
                "cpu_percent": 0.0,
                "in_flight": "?",
                "served": "?",
                "errors": "?",
                "last_error": "",
            }
        )
    return rows


def _inspect_once(runtime_dir: str, as_json: bool) -> int:
    try:
        rows = _ask_list(runtime_dir, "workers")
        models = _ask_list(runtime_dir, "models")
    except (Unreachable, Refused) as error:
        print(f"degraded mode: {error}; workers below were found by process title", file=sys.stderr)
        rows, models, code = rows_from_titles(runtime_dir), [], UNREACHABLE
    else:
        code = DEGRADED if any(m["degraded"] for m in models) else OK
    if as_json:
        print(json.dumps({"workers": rows, "models": models, "degraded_mode": code == UNREACHABLE}, indent=1))
    else:
        print(table(rows))
        for model in models:
            if model["degraded"]:
                print(
                    f"degraded: {model['model']} has {model['replicas_ready']}/{model['replicas_wanted']} "
                    f"replicas ready{' (healing)' if model['healing'] else ''}"
                )
    return code


def _seconds(text: str) -> float:
    """--watch's period: time.sleep() refuses a negative or NaN one only after the first screen."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds, 0 or more, got {text!r}")
    return value


def inspect_workers(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="inspect-workers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")
    parser.add_argument(
        "--watch",
        nargs="?",
        type=_seconds,
        const=2.0,
        metavar="SECONDS",
        help="refresh like top (default every 2 s)",
    )
    parser.add_argument("--runtime-dir", help="RUNTIME_DIR of the runtime (default: from the environment)")
    options = parser.parse_args(argv)
    runtime_dir = _runtime_dir(options.runtime_dir)
    if options.watch is None:
        return _inspect_once(runtime_dir, options.json)
    code = UNREACHABLE  # interrupted before the first look answered (a front that does not answer)
    try:
        while True:
            print("\x1b[H\x1b[2J", end="")
            print(time.strftime("%H:%M:%S"), f"mesh-runtime workers ({runtime_dir})")
            code = _inspect_once(runtime_dir, options.json)
            sys.stdout.flush()
            time.sleep(options.watch)
    except KeyboardInterrupt:
        return code


def _target_command(prog: str, command: str, argv: list[str] | None, show) -> int:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("target", metavar="PID|MODEL")
    parser.add_argument("--runtime-dir", help="RUNTIME_DIR of the runtime (default: from the environment)")
    options = parser.parse_args(argv)
    try:
        result = ask(_runtime_dir(options.runtime_dir), command, options.target)
    except Unreachable as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return UNREACHABLE
    except Refused as error:
        print(f"{prog}: {error}", file=sys.stderr)
        return DEGRADED
    show(result)
    return OK


def worker_stacks(argv: list[str] | None = None) -> int:
    def show(stacks: dict) -> None:
        for pid, text in stacks.items():
            print(f"== worker {pid} ==\n{text}")

    return _target_command("worker-stacks", "stacks", argv, show)


def kill_worker(argv: list[str] | None = None) -> int:
    return _target_command(
        "kill-worker", "kill", argv, lambda pids: print("killed " + " ".join(map(str, pids)))
    )


if __name__ == "__main__":
    commands = {
        "inspect-workers": inspect_workers,
        "worker-stacks": worker_stacks,
        "kill-worker": kill_worker,
    }
    sys.exit(commands[sys.argv[1]](sys.argv[2:]))
