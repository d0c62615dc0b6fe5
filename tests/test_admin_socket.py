"""The admin socket against hostile peers: every message is survived, answered or dropped, and logged.

Each case sends one kind of bad message with a raw socket to a live runtime,
then checks that a normal REQ request (what scripts/inspect-workers sends)
still answers and that the runtime logged the bad message.
"""

import asyncio
import json
import os
import socket
import subprocess
import types

import pytest
import zmq
from harness import REPO, wait_until

from runtime import admin
from runtime.admin import cli

OK_REQUEST = json.dumps({"command": "models", "args": []}).encode()


@pytest.fixture(scope="module")
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def address(runtime) -> str:
    return f"ipc://{admin.socket_path(runtime.env['RUNTIME_DIR'])}"


def dealer_exchange(context, runtime, frames: list[bytes], wait_ms: int) -> list[bytes] | None:
    """Sends `frames` as one message from a fresh DEALER; the reply, or None if none came in wait_ms."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)  # the message must leave before the socket closes
    try:
        sock.connect(address(runtime))
        sock.send_multipart(frames)
        return sock.recv_multipart() if sock.poll(wait_ms) else None
    finally:
        sock.close()


def still_serves(runtime) -> None:
    assert cli.ask(runtime.env["RUNTIME_DIR"], "models") == []
    assert cli.ask(runtime.env["RUNTIME_DIR"], "pool")["workers"] >= 1


def logged_since(runtime, start: int, fragment: str) -> str:
    """The first line of the runtime log past offset `start` that holds `fragment` (waits for it)."""

    def find():
        return next((line for line in runtime.log()[start:].splitlines() if fragment in line), None)

    line = wait_until(find, timeout=5, what=f"a log line with {fragment!r}")
    assert "WARNING" in line.upper(), line
    return line


DEEP = b"[" * 50_000  # under the size limit; json.loads recurses too deep on it
HOSTILE = [
    pytest.param([b"", OK_REQUEST, b"extra"], "2 frames", "refused a message", id="extra-frame"),
    pytest.param([b"", OK_REQUEST, b"", OK_REQUEST], "3 frames", "refused a message", id="two-requests"),
    pytest.param([OK_REQUEST], None, "no REQ envelope", id="no-envelope"),
    pytest.param([b"x", b"", OK_REQUEST], None, "no REQ envelope", id="wrong-delimiter"),
    pytest.param([b""], None, "no REQ envelope", id="delimiter-only"),
    pytest.param([b"", b"\x00\x01garbage\xfe\x02"], "not UTF-8", "not UTF-8", id="garbage-bytes"),
    pytest.param([b"", b"\xff\xfe{}"], "not UTF-8", "not UTF-8", id="non-utf8"),
    pytest.param([b"", b"workers please"], "not JSON", "not JSON", id="non-json"),
    pytest.param([b"", b""], "not JSON", "not JSON", id="empty"),
    pytest.param([b"", b"[1, 2]"], "JSON array", "JSON array", id="json-list"),
    pytest.param([b"", b'"workers"'], "JSON string", "JSON string", id="json-string"),
    pytest.param([b"", b'{"args": []}'], 'no "command"', 'no "command"', id="no-command"),
    pytest.param(
        [b"", b'{"command": ["workers"]}'], '"command" is a JSON array', "command", id="command-list"
    ),
    pytest.param([b"", b'{"command": {}}'], '"command" is a JSON object', "command", id="command-object"),
    pytest.param(
        [b"", b'{"command": "kill", "args": "123"}'], '"args" is a JSON string', "args", id="args-string"
    ),
    pytest.param(
        [b"", b'{"command": "kill", "args": {"pid": 1}}'], '"args" is a JSON object', "args", id="args-object"
    ),
    pytest.param(
        [b"", b'{"command": "kill", "args": [[1]]}'], "other than strings", "args", id="args-nested"
    ),
    pytest.param([b"", b'{"command": "kill", "args": [true]}'], "other than strings", "args", id="args-bool"),
    pytest.param(
        [b"", b'{"command": "kill", "args": [' + b"9" * 5000 + b"]}"], "not JSON", "not JSON", id="huge-int"
    ),
    pytest.param([b"", DEEP], "not JSON", "not JSON", id="deep-nesting"),
    pytest.param(
        [b"", b" " * (admin.MAX_REQUEST_BYTES + 1)], "the limit is", "the limit is", id="long-request"
    ),
]


@pytest.mark.parametrize("frames, answer, logged", HOSTILE)
def test_hostile_message_is_refused_logged_and_survived(context, runtime, frames, answer, logged):
    start = len(runtime.log())
    reply = dealer_exchange(context, runtime, frames, wait_ms=3000 if answer else 300)
    if answer is None:
        assert reply is None
    else:
        assert reply is not None and reply[0] == b"" and len(reply) == 2
        body = json.loads(reply[1])
        assert body["ok"] is False and answer in body["error"], body
    assert "admin socket" in logged_since(runtime, start, logged)
    still_serves(runtime)


def test_frame_past_the_zeromq_cap_drops_its_sender(context, runtime):
    huge = b"{" + b" " * (admin.MAX_FRAME_BYTES + 1) + b"}"
    assert dealer_exchange(context, runtime, [b"", huge], wait_ms=500) is None
    still_serves(runtime)


def test_flood_without_reading_answers(context, runtime):
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.RCVHWM, 1)
    try:
        sock.connect(address(runtime))
        for _ in range(300):
            sock.send_multipart([b"", b"[]"])
        still_serves(runtime)
    finally:
        sock.close()
    still_serves(runtime)


def test_peer_that_leaves_before_its_answer(context, runtime):
    start = len(runtime.log())
    spare = str(runtime.spares()[0].pid)  # stacks takes a moment: the peer is gone by the answer
    request = json.dumps({"command": "stacks", "args": [spare]}).encode()
    assert dealer_exchange(context, runtime, [b"", request], wait_ms=0) is None
    assert "admin socket" in logged_since(runtime, start, "dropped the answer")
    still_serves(runtime)


ZMTP3_SIGNATURE = b"\xff" + bytes(8) + b"\x7f"
RAW_PEERS = [
    pytest.param(b"GET / HTTP/1.0\r\n\r\n", True, id="http"),
    pytest.param(
        ZMTP3_SIGNATURE + b"\x03\x00" + b"NOPE".ljust(20, b"\x00") + bytes(32), True, id="unknown-mechanism"
    ),
    pytest.param(b"", True, id="connect-and-vanish"),
    # Bytes libzmq takes for a ZMTP 1.0 frame of 2**48 bytes: it drops the peer without
    # reporting a failed handshake, so there is nothing to log, only to survive.
    pytest.param(b"\xff" + bytes(range(256)), False, id="zmtp1-huge-frame"),
]


@pytest.mark.parametrize("data, logged", RAW_PEERS)
def test_peer_that_does_not_speak_zeromq(runtime, data, logged):
    start = len(runtime.log())
    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(admin.socket_path(runtime.env["RUNTIME_DIR"]))
        raw.sendall(data)
    if logged:
        assert "admin socket" in logged_since(runtime, start, "failed the ZeroMQ handshake")
    still_serves(runtime)


@pytest.mark.parametrize(
    "target", ["²", "9" * 5000, "-1", ""], ids=["superscript", "long", "negative", "empty"]
)
def test_kill_with_odd_targets_is_refused_not_failed(runtime, target):
    with pytest.raises(cli.Refused, match="no worker with pid or model"):
        cli.ask(runtime.env["RUNTIME_DIR"], "kill", target)
    assert "admin command kill failed" not in runtime.log()


def test_inspect_workers_json_answers_after_all_that(runtime):
    done = subprocess.run(
        [
            os.path.join(REPO, "scripts", "inspect-workers"),
            "--json",
            "--runtime-dir",
            runtime.env["RUNTIME_DIR"],
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    parsed = json.loads(done.stdout)
    assert parsed["degraded_mode"] is False and parsed["workers"]
    assert "Traceback" not in runtime.log()


# -- a command that fails, in process (no runtime can be made to have such a bug) --------------


def _serve_with(tmp_path, commands: dict, requests: list[tuple[str, ...]]) -> list:
    """Starts an AdminServer whose commands are `commands`, asks it `requests` through cli.ask."""

    async def scenario():
        server = admin.AdminServer(supervisor=None, settings=types.SimpleNamespace(runtime_dir=str(tmp_path)))
        server.commands.update(commands)
        server.start()
        try:
            answers = []
            for request in requests:
                try:
                    answers.append(await asyncio.to_thread(cli.ask, str(tmp_path), *request))
                except cli.Refused as refused:
                    answers.append(f"refused: {refused}")
            return answers, all(not task.done() for task in server._tasks)
        finally:
            await server.close()

    return asyncio.run(scenario())


def command(run):
    return types.SimpleNamespace(run=run, __doc__="a test command")


def test_a_command_that_raises_answers_an_error_and_serving_goes_on(tmp_path, caplog):
    async def broken(supervisor, args):
        raise RuntimeError("a bug")

    async def circular(supervisor, args):
        loop = []
        loop.append(loop)
        return loop

    async def fine(supervisor, args):
        return args

    answers, serving = _serve_with(
        tmp_path,
        {"workers": command(broken), "models": command(circular), "pool": command(fine)},
        [("workers",), ("models",), ("pool", "a", "b")],
    )
    assert answers == [
        "refused: workers failed: RuntimeError: a bug",
        "refused: the answer is not JSON: Circular reference detected",
        ["a", "b"],
    ]
    assert serving
    assert any(
        record.levelname == "ERROR" and "admin command workers failed" in record.getMessage()
        for record in caplog.records
    )


def test_a_target_is_a_pid_first_and_else_a_model_id_even_one_of_digits():
    workers = [types.SimpleNamespace(pid=pid, models=models) for pid, models in ((41, ["7"]), (7, ["m"]))]
    supervisor = types.SimpleNamespace(pool=types.SimpleNamespace(workers=lambda: workers))
    assert admin.find_workers(supervisor, "7") == [workers[1]]  # the pid wins
    assert admin.find_workers(supervisor, "41") == [workers[0]]
    workers[1].pid = 8
    assert admin.find_workers(supervisor, "7") == [workers[0]]  # no such pid: the model "7"
    with pytest.raises(admin.AdminError):
        admin.find_workers(supervisor, "9")
