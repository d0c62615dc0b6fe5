"""bench/canned_server.py, the reference servers of the data-plane benchmark (cases a and a2)."""

import asyncio
import os
import signal
import subprocess

import grpc
import psutil
import pytest
from harness import REPO, expect_status, free_port, wait_until

from bench import canned_server, h2load
from bench.servers import canned_command

METHOD = "/inference.GRPCInferenceService/ModelInfer"
ANSWER = b"\x0a\x04echo"  # a ModelInferResponse with model_name "echo"


@pytest.fixture
def start_canned(tmp_path):
    started = []

    def start(*options):
        answer = tmp_path / "answer.bin"
        answer.write_bytes(ANSWER)
        port = free_port()
        process = subprocess.Popen(
            canned_command(port, str(answer), *options),
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(process)
        assert process.stdout.readline().split() == ["ready", str(port)]
        return process, port

    yield start
    for process in started:
        process.kill()
        process.wait()


def infer(port: int, body: bytes) -> bytes:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return channel.unary_unary(METHOD)(body, timeout=10)


def _loaded_uvloop(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "/uvloop/" in maps.read()


@pytest.mark.parametrize(
    "options", [(), ("--uvloop",), ("--hop", "--uvloop")], ids=["canned", "uvloop", "hop"]
)
def test_answers_every_call_with_the_fixed_bytes(start_canned, options):
    process, port = start_canned(*options)
    assert [infer(port, bytes([n]) * n) for n in (0, 1, 100)] == [ANSWER] * 3
    assert _loaded_uvloop(process.pid) == ("--uvloop" in options)
    if not options:  # (a) is a bare grpc.aio server: no thread gets another scheduling policy
        assert {os.sched_getscheduler(thread.id) for thread in psutil.Process(process.pid).threads()} == {
            os.SCHED_OTHER
        }
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        expect_status(
            grpc.StatusCode.UNIMPLEMENTED,
            channel.unary_unary("/inference.GRPCInferenceService/ModelMetadata"),
            b"",
            timeout=10,
        )


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_hop_child_ends_with_its_server(start_canned, how):
    process, port = start_canned("--hop")
    assert infer(port, b"x") == ANSWER
    (child,) = psutil.Process(process.pid).children()
    assert os.sched_getscheduler(child.pid) == os.SCHED_BATCH  # scheduled as mesh-runtime's workers are
    front_policies = {os.sched_getscheduler(thread.id) for thread in psutil.Process(process.pid).threads()}
    assert front_policies == {os.SCHED_OTHER, os.SCHED_BATCH}  # grpc's threads as in mesh-runtime's front
    process.send_signal(how)
    process.wait(10)
    wait_until(
        lambda: not child.is_running() or child.status() == psutil.STATUS_ZOMBIE, what="the hop child to exit"
    )


def test_hop_drops_the_answer_to_a_call_its_client_gave_up():
    """grpc cancels a call whose client went away; its late answer must not break the next ones."""

    async def scenario():
        errors = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: errors.append(context))
        hop = canned_server.Hop(ANSWER)
        hop.start()
        try:
            given_up = asyncio.ensure_future(hop._forward(b"first", None))
            await asyncio.sleep(0)  # sent; now waiting for the answer
            given_up.cancel()
            assert await asyncio.wait_for(hop._forward(b"second", None), 10) == ANSWER
            await asyncio.sleep(0.2)  # the first answer has come and gone by now
            assert errors == []
        finally:
            hop.stop()

    asyncio.run(scenario())


def test_the_page_faults_of_a_process_are_counted_from_proc():
    me = psutil.Process()
    before = h2load.tree_faults([me])[me.pid]
    touched = bytearray(8 * 1024 * 1024)  # fresh pages: each one faults on first write
    for offset in range(0, len(touched), 4096):
        touched[offset] = 1
    assert h2load.tree_faults([me])[me.pid] - before >= 1024
