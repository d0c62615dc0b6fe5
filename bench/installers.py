"""The tools the benchmark drives, installed on first use: h2load, MLServer, valgrind.

h2load and nghttp (Debian's nghttp2-client) and valgrind come from apt-get, when they are
missing and we are root; MLServer goes into its own venv, .bench/mlserver-venv, so that its
dependencies never meet the project's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from bench.common import REPO, progress

MLSERVER_VERSION = "1.7.1"
MLSERVER_VENV = os.path.join(REPO, ".bench", "mlserver-venv")


def ensure_h2load() -> str:
    """h2load's path; installs nghttp2-client with apt-get when it is missing."""
    if shutil.which("h2load") is None or shutil.which("nghttp") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise RuntimeError("h2load is missing: install the Debian package nghttp2-client")
        progress("installing h2load (apt-get install nghttp2-client)")
        subprocess.run(
            "apt-get update -q && apt-get install -y -q nghttp2-client",
            shell=True,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    version = subprocess.run(["h2load", "--version"], capture_output=True, text=True).stdout.strip()
    return version.replace("h2load ", "")


def ensure_mlserver() -> str:
    """The mlserver executable in .bench/mlserver-venv, installed there on first use."""
    stamp = os.path.join(MLSERVER_VENV, f".installed-mlserver-{MLSERVER_VERSION}")
    executable = os.path.join(MLSERVER_VENV, "bin", "mlserver")
    if os.path.exists(stamp) and os.path.exists(executable):
        return executable
    progress(
        f"installing mlserver=={MLSERVER_VERSION} mlserver-sklearn into .bench/mlserver-venv "
        "(a few minutes, once)"
    )
    base = getattr(sys, "_base_executable", None) or shutil.which("python3")
    log_path = os.path.join(REPO, ".bench", "mlserver-install.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "w") as log:
        steps = [
            [base, "-m", "venv", MLSERVER_VENV],
            [
                os.path.join(MLSERVER_VENV, "bin", "python"),
                "-m",
                "pip",
                "install",
                "-q",
                f"mlserver=={MLSERVER_VERSION}",
                f"mlserver-sklearn=={MLSERVER_VERSION}",
            ],
        ]
        for step in steps:
            if subprocess.run(step, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                with open(log_path) as f:
                    tail = f.read()[-2000:]
                raise RuntimeError(
                    f"installing MLServer failed ({' '.join(step[-3:])}); log {log_path}:\n{tail}"
                )
    open(stamp, "w").close()
    return executable


def package_version(python: str, name: str) -> str:
    found = subprocess.run(
        [python, "-c", f"import importlib.metadata as m; print(m.version({name!r}))"],
        capture_output=True,
        text=True,
    )
    return found.stdout.strip() or "?"


def ensure_valgrind() -> str:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        if os.geteuid() != 0 or shutil.which("apt-get") is None:
            raise RuntimeError("valgrind is missing: install the Debian package valgrind")
        progress("installing valgrind (apt-get install valgrind)")
        subprocess.run(
            "apt-get update -q && apt-get install -y -q valgrind",
            shell=True,
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return subprocess.run(["valgrind", "--version"], capture_output=True, text=True).stdout.strip()
