"""The admin socket: operators' scripts ask the running front what it is doing.

JSON over ZeroMQ on ipc://RUNTIME_DIR/admin.sock (the file mode 0600, inside
the 0700 RUNTIME_DIR): clients use a REQ socket. A request is {"command":
NAME, "args": [STRING, ...]}; the answer is {"ok": true, "result": ...} or
{"ok": false, "error": "..."}.

Any message is survived: one that is not a request of that shape gets an
error answer (or none, without a REQ envelope) and a warning in the log, a
frame over MAX_FRAME_BYTES makes ZeroMQ drop its sender, and a command that
raises answers an error. Requests are served one at a time.

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
from zmq.utils import monitor

log = logging.getLogger("mesh.admin")

COMMANDS = ("workers", "models", "pool", "stacks", "kill")
SOCKET_NAME = "admin.sock"
USAGE = 'expected JSON {"command": NAME, "args": [STRING, ...]}'
# Requests are a few hundred bytes. A longer one is refused with an answer; a
# frame past MAX_FRAME_BYTES never reaches us: ZeroMQ drops its sender.
MAX_REQUEST_BYTES = 64 * 1024
MAX_FRAME_BYTES = 1024 * 1024
# What a peer that does not speak ZeroMQ (or leaves mid-greeting) shows up as.
HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_JSON_TYPES = {
    dict: "object",
    list: "array",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


class AdminError(Exception):
    """A request the admin socket refuses; the message goes back to the client."""


class BadRequest(Exception):
    """A message that is not a request at all; refused, and logged as a warning."""


def socket_path(runtime_dir: str) -> str:
    return os.path.join(runtime_dir, SOCKET_NAME)


def find_workers(supervisor, target: str) -> list:
    """The workers a PID or a model id names."""
    workers = supervisor.pool.workers()
    # Compared as text: int() refuses some digits ("²") and very long numbers. A model id may be
    # all digits too: it is looked up as one when no worker has that pid.
    found = [w for w in workers if str(w.pid) == target] or [w for w in workers if target in w.models]
    if not found:
        raise AdminError(f"no worker with pid or model {target!r}")
    return found


def parse(raw: bytes) -> tuple[str, list[str]]:
    """The command and arguments in one request frame; raises BadRequest."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise BadRequest(f"a request of {len(raw)} bytes; the limit is {MAX_REQUEST_BYTES}")
    try:
        request = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadRequest(f"the request is not UTF-8; {USAGE}") from None
    except (ValueError, RecursionError) as error:  # RecursionError: arrays nested too deep
        raise BadRequest(f"the request is not JSON ({error}); {USAGE}") from None
    if not isinstance(request, dict):
        raise BadRequest(f"the request is a JSON {_JSON_TYPES[type(request)]}; {USAGE}")
    if "command" not in request:
        raise BadRequest(f'the request has no "command"; {USAGE}')
    name, args = request["command"], request.get("args", [])
    if not isinstance(name, str):
        raise BadRequest(f'"command" is a JSON {_JSON_TYPES[type(name)]}, not a string; {USAGE}')
    if not isinstance(args, list):
        raise BadRequest(f'"args" is a JSON {_JSON_TYPES[type(args)]}, not an array; {USAGE}')
    if not all(type(arg) in (str, int) for arg in args):  # type(), not isinstance: bool is an int
        raise BadRequest(f'"args" holds something other than strings; {USAGE}')
    return name, [str(arg) for arg in args]


class AdminServer:
    def __init__(self, supervisor, settings):
        self.supervisor = supervisor
        self.path = socket_path(settings.runtime_dir)
        self.commands = {name: importlib.import_module(f"runtime.admin.{name}") for name in COMMANDS}
        self._context = zmq.asyncio.Context()
        # ROUTER with the REQ envelope handled here, not REP: REP's state machine
        # fails (EFSM) on any message that is not exactly one REQ request.
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # An answer that cannot be delivered raises, so it is logged rather than lost unseen.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._monitor = self._socket.get_monitor_socket(HANDSHAKE_FAILURES)
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._socket.bind(f"ipc://{self.path}")
        os.chmod(self.path, 0o600)
        self._tasks = [
            asyncio.create_task(self._serve_forever(), name="admin"),
            asyncio.create_task(self._log_handshake_failures(), name="admin-monitor"),
        ]
        for task in self._tasks:
            task.add_done_callback(_report_stop)
        log.info("admin socket at %s", self.path)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)
        self._context.term()

    async def _serve_forever(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                await self._serve(frames)
            except Exception:
                log.exception("admin socket: serving a message failed; serving on")

    async def _serve(self, frames: list[bytes]) -> None:
        """One message as ROUTER hands it over: [peer, b"", request] from a REQ client."""
        peer = frames[0].hex()
        if len(frames) < 3 or frames[1] != b"":
            log.warning("admin socket: dropped a message from peer %s: no REQ envelope", peer)
            return
        try:
            if len(frames) != 3:
                raise BadRequest(f"a message of {len(frames) - 2} frames; a request is one frame")
            name, args = parse(frames[2])
        except BadRequest as error:
            log.warning("admin socket: refused a message from peer %s: %s", peer, error)
            answer = {"ok": False, "error": str(error)}
        else:
            answer = await self.answer(name, args)
        await self._send(frames[0], answer)

    async def answer(self, name: str, args: list[str]) -> dict:
        if name == "help":
            return {"ok": True, "result": {n: (m.__doc__ or "").strip() for n, m in self.commands.items()}}
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

    async def _send(self, peer: bytes, answer: dict) -> None:
        try:
            body = json.dumps(answer, default=str).encode()
        except (TypeError, ValueError, RecursionError) as error:
            log.exception("admin socket: the answer is not JSON")
            body = json.dumps({"ok": False, "error": f"the answer is not JSON: {error}"}).encode()
        try:
            # NOBLOCK: a peer that sends without reading must not stall the socket for everyone.
            await self._socket.send_multipart([peer, b"", body], flags=zmq.NOBLOCK)
        except zmq.ZMQError as error:  # EHOSTUNREACH: it left; EAGAIN: it does not read its answers
            log.warning(
                "admin socket: dropped the answer to peer %s (it left or does not read): %s",
                peer.hex(),
                error,
            )

    async def _log_handshake_failures(self) -> None:
        while True:
            event = monitor.parse_monitor_message(await self._monitor.recv_multipart())
            kind, value = zmq.Event(event["event"]), event["value"]
            # The value is an errno for NO_DETAIL, a ZMQ_PROTOCOL_ERROR_* code otherwise.
            no_detail = kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            detail = os.strerror(value) if no_detail else f"code {value:#x}"
            log.warning("admin socket: a peer failed the ZeroMQ handshake (%s: %s)", kind.name, detail)


def _report_stop(task: asyncio.Task) -> None:
    """The serving tasks end only when closed; say so loudly if one ever stops otherwise."""
    if not task.cancelled() and task.exception() is not None:
        log.error("admin socket: %s stopped", task.get_name(), exc_info=task.exception())
