"""The admin socket: operators' scripts ask the running front what it is doing.

JSON over ZeroMQ REQ/REP on ipc://RUNTIME_DIR/admin.sock (the file mode 0600,
inside the 0700 RUNTIME_DIR). A request is {"command": NAME, "args": [...]};
the answer is {"ok": true, "result": ...} or {"ok": false, "error": "..."}.

Each command is one module in this package with `async def run(supervisor,
args)`; its docstring is its help, and the `help` command lists them. The
scripts in scripts/ (inspect-workers, worker-stacks, kill-worker) are the
clients.
"""
from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os

import zmq
import zmq.asyncio

log = logging.getLogger("mesh.admin")

COMMANDS = ("workers", "models", "pool", "stacks", "kill")
SOCKET_NAME = "admin.sock"


class AdminError(Exception):
    """A request the admin socket refuses; the message goes back to the client."""


def socket_path(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, SOCKET_NAME)


def find_workers(supervisor, target: str) -> list:
    """The workers a PID or a model id names."""
    workers = supervisor.pool.workers()
    if target.isdigit():
        found = [w for w in workers if w.pid == int(target)]
    else:
        found = [w for w in workers if w.model_id == target]
    if not found:
        raise AdminError(f"no worker with pid or model {target!r}")
    return found


class AdminServer:
    def __init__(self, supervisor, settings):
        self.supervisor = supervisor
        self.path = socket_path(settings.runtime_dir)
        self.commands = {name: importlib.import_module(f"runtime.admin.{name}") for name in COMMANDS}
        self._context = zmq.asyncio.Context()
        self._socket = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._socket = self._context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"ipc://{self.path}")
        os.chmod(self.path, 0o600)
        self._task = asyncio.create_task(self._serve_forever(), name="admin")
        log.info("admin socket at %s", self.path)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)
        self._context.term()

    async def _serve_forever(self) -> None:
        while True:
            raw = await self._socket.recv()
            answer = await self.answer(raw)
            await self._socket.send(json.dumps(answer, default=str).encode())

    async def answer(self, raw: bytes) -> dict:
        try:
            request = json.loads(raw)
            name, args = request["command"], [str(a) for a in request.get("args", [])]
        except (ValueError, KeyError, TypeError, AttributeError):
            return {"ok": False, "error": 'expected JSON {"command": NAME, "args": [...]}'}
        if name == "help":
            return {"ok": True, "result": {n: m.__doc__.strip() for n, m in self.commands.items()}}
        command = self.commands.get(name)
        if command is None:
            return {"ok": False, "error": f"unknown command {name!r}; commands: help, {', '.join(COMMANDS)}"}
        try:
            return {"ok": True, "result": await command.run(self.supervisor, args)}
        except AdminError as error:
            return {"ok": False, "error": str(error)}
        except Exception as error:
            log.exception("admin command %s failed", name)
            return {"ok": False, "error": f"{name} failed: {type(error).__name__}: {error}"}
