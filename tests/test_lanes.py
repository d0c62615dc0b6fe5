"""Call lanes (workers/lanes.py, runtime/lanes.py, workers/inbox.py): small messages over a unix
SOCK_SEQPACKET connection, everything else over the worker socket, in the order sent."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import time

import msgpack
import numpy as np
import pytest
import zmq
from harness import Runtime, mesh_headers
from test_channel import until

from protos import grpc_predict_v2_pb2 as v2
from runtime.admin import cli
from runtime.channel import Channel, PeerGone
from runtime.lanes import FrontLanes
from workers import lanes, protocol
from workers.holding import Holdings
from workers.inbox import Inbox

# -- packets --------------------------------------------------------------------------------


def test_a_packet_carries_its_frames_whole_and_in_order():
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    frames = [b"header", b"", memoryview(b"payload"), array.data]
    data = b"".join(bytes(part) for part in lanes.packet(frames))
    header, *payloads = lanes.frames_of(data)
    assert header == b"header" and type(header) is bytes
    assert [bytes(p) for p in payloads] == [b"", b"payload", array.tobytes()]


def test_a_message_too_big_for_a_lane_is_left_to_the_socket():
    assert lanes.packet([b"h", bytes(lanes.LANE_MESSAGE_MAX)]) is None
    assert lanes.packet([b"h", bytes(lanes.LANE_MESSAGE_MAX - 1)]) is not None
    assert lanes.packet([b""] * (lanes.FRAMES_MAX + 1)) is None


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00", b"\x02\x01\x00\x00\x00", b"\x01\x05\x00\x00\x00abc", b"\x01\x01\x00\x00\x00abc"],
    ids=["empty", "no frames", "sizes cut short", "frames shorter", "frames longer"],
)
def test_a_packet_that_is_not_one_of_ours_is_refused(data):
    with pytest.raises(lanes.LaneError):
        lanes.frames_of(data)


# -- the front's channel with a hand-driven worker ------------------------------------------


class LaneWorker:
    """A DEALER socket and a call lane, answered by hand."""

    def __init__(self, address: str, lanes_path: str | None, identity: bytes = b"w1"):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity)
        self.socket.connect(address)
        self.lane = lanes.connect(lanes_path, identity) if lanes_path else None
        self.socket.send(protocol.header(protocol.OP_HELLO, pid=os.getpid()))

    def take_from_lane(self) -> tuple[dict, list]:
        assert self.lane is not None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            packets = lanes.receive_one(self.lane)
            if packets:
                header, *payloads = lanes.frames_of(packets[0])
                return msgpack.unpackb(header), [bytes(p) for p in payloads]
            time.sleep(0.005)
        raise AssertionError("nothing came over the lane")

    def take_from_socket(self) -> tuple[dict, list]:
        assert self.socket.poll(5000), "nothing came over the socket"
        header, *payloads = self.socket.recv_multipart()
        return msgpack.unpackb(header), payloads

    def answer_over_lane(self, request_id: int, body: bytes = b"done") -> None:
        assert self.lane is not None and lanes.send(self.lane, [protocol.reply(request_id), body])

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        self.socket.close(linger=0)
        self.context.term()


@pytest.fixture
def run(tmp_path):
    """Runs an async test with a started Channel (lanes on) and a connected LaneWorker; the test
    gets the list of (op, id) of every message the channel handed on, in order."""

    def runner(test, pid_of=lambda peer: os.getpid()):
        async def main():
            heard: list[tuple[str, int]] = []
            channel = Channel(
                f"ipc://{tmp_path}/channel.sock",
                lambda peer, header: heard.append((header["op"], header["id"])),
                lanes_path=f"{tmp_path}/lanes.sock",
                pid_of=pid_of,
            )
            channel.start()
            worker = LaneWorker(channel.address, channel.lanes_address)
            try:
                await until(lambda: (protocol.OP_HELLO, 0) in heard)
                await test(channel, worker, heard)
            finally:
                worker.close()
                await channel.close()

        asyncio.run(main())

    return runner


async def lane_named(channel: Channel, peer: bytes = b"w1") -> None:
    assert channel.lanes is not None
    await until(lambda: peer in channel.lanes._lanes)


def test_a_small_call_and_its_reply_go_over_the_lane(run):
    async def test(channel, worker, heard):
        await lane_named(channel)
        future = channel.submit(b"w1", protocol.OP_CALL, [b"request"], method="m", deadline=None)
        header, payloads = worker.take_from_lane()
        assert header["op"] == protocol.OP_CALL and payloads == [b"request"]
        worker.answer_over_lane(header["id"], b"response")
        reply, frames = await asyncio.wait_for(future, 5)
        assert reply["ok"] and [bytes(f) for f in frames] == [b"response"]
        assert not worker.socket.poll(0), "nothing went over the socket"

    run(test)


def test_a_call_too_big_for_the_lane_goes_over_the_socket(run):
    async def test(channel, worker, heard):
        await lane_named(channel)
        big = bytes(lanes.LANE_MESSAGE_MAX)
        future = channel.submit(b"w1", protocol.OP_CALL, [big], method="m", deadline=None)
        header, payloads = worker.take_from_socket()
        assert payloads == [big]
        worker.answer_over_lane(header["id"])
        await asyncio.wait_for(future, 5)

    run(test)


def test_a_socket_message_says_how_many_went_over_the_lane_before_it(run):
    async def test(channel, worker, heard):
        await lane_named(channel)
        channel.submit(b"w1", protocol.OP_CALL, [b"a"], method="m", deadline=None)
        channel.submit(b"w1", protocol.OP_CALL, [bytes(lanes.LANE_MESSAGE_MAX)], method="m", deadline=None)
        assert worker.take_from_lane()[0]["id"] == 1
        header, _ = worker.take_from_socket()
        assert header["id"] == 2 and header[protocol.LANE_FIELD] == 1

    run(test)


def test_calls_behind_one_sent_over_the_socket_follow_it_there_until_it_is_answered(run):
    # Over the lane they could reach the worker before it, which would run them first.
    async def test(channel, worker, heard):
        await lane_named(channel)
        big = channel.submit(
            b"w1", protocol.OP_CALL, [bytes(lanes.LANE_MESSAGE_MAX)], method="m", deadline=None
        )
        small = channel.submit(b"w1", protocol.OP_CALL, [b"small"], method="m", deadline=None)
        assert [worker.take_from_socket()[1][-1] == b"small" for _ in range(2)] == [False, True]
        assert lanes.receive_one(worker.lane) == [], "nothing over the lane"
        for future in (big, small):
            request_id = next(iter(channel._pending))
            worker.answer_over_lane(request_id)
            await asyncio.wait_for(future, 5)
        after = channel.submit(b"w1", protocol.OP_CALL, [b"after"], method="m", deadline=None)
        header, payloads = worker.take_from_lane()
        assert payloads == [b"after"]
        worker.answer_over_lane(header["id"])
        await asyncio.wait_for(after, 5)

    run(test)


def test_calls_the_full_lane_cannot_take_go_over_the_socket(run):
    async def test(channel, worker, heard):
        await lane_named(channel)
        body = bytes(lanes.LANE_MESSAGE_MAX - 100)
        futures = [
            channel.submit(b"w1", protocol.OP_CALL, [body], method="m", deadline=None) for _ in range(40)
        ]
        over_socket = []
        while worker.socket.poll(200):
            over_socket.append(worker.take_from_socket()[0]["id"])
        over_lane = []
        while packets := lanes.receive_one(worker.lane):
            over_lane.append(msgpack.unpackb(lanes.frames_of(packets[0])[0])["id"])
        assert over_lane and over_socket, "the lane took some, the socket the rest"
        assert sorted(over_lane + over_socket) == sorted(channel._pending)
        for request_id in over_lane + over_socket:
            worker.answer_over_lane(request_id)
        await asyncio.wait_for(asyncio.gather(*futures), 5)

    run(test)


def test_what_came_over_the_lane_is_handed_on_before_a_later_socket_message(run):
    async def test(channel, worker, heard):
        await lane_named(channel)
        first = channel.submit(b"w1", protocol.OP_CALL, [b"a"], method="m", deadline=None)
        second = channel.submit(b"w1", protocol.OP_CALL, [b"b"], method="m", deadline=None)
        first_id = worker.take_from_lane()[0]["id"]
        second_id = worker.take_from_lane()[0]["id"]
        worker.answer_over_lane(first_id)
        worker.socket.send_multipart([protocol.reply(second_id), b"done"])
        time.sleep(0.2)  # the event loop runs no reader meanwhile: both wait
        channel._drain()  # the socket's message: the lane is read first
        assert heard[-2:] == [(protocol.OP_REPLY, first_id), (protocol.OP_REPLY, second_id)]
        await asyncio.wait_for(asyncio.gather(first, second), 5)

    run(test)


def test_replies_a_dead_worker_sent_over_its_lane_still_answer_their_calls(run):
    async def test(channel, worker, heard):
        await lane_named(channel)
        answered = channel.submit(b"w1", protocol.OP_CALL, [b"a"], method="m", deadline=None)
        unanswered = channel.submit(b"w1", protocol.OP_CALL, [b"b"], method="m", deadline=None)
        worker.answer_over_lane(worker.take_from_lane()[0]["id"], b"first")
        channel.fail_peer(b"w1", -9)  # at once, before the loop reads the lane
        reply, frames = await asyncio.wait_for(answered, 5)
        assert [bytes(f) for f in frames] == [b"first"]
        assert heard[-1] == (protocol.OP_HELLO, 0), "a dead worker's reply proves no one alive"
        with pytest.raises(PeerGone):
            await asyncio.wait_for(unanswered, 5)

    run(test)


def test_a_reply_waiting_on_the_lane_is_read_before_its_call_is_judged_overdue(run):
    def overdue() -> BaseException:
        return TimeoutError("judged overdue")

    async def test(channel, worker, heard):
        await lane_named(channel)
        future = channel.submit(
            b"w1", protocol.OP_CALL, [b"a"], method="m", deadline=None, overdue_after=60, on_overdue=overdue
        )
        request_id = worker.take_from_lane()[0]["id"]
        worker.answer_over_lane(request_id, b"in time")
        # As its timer does when the event loop stalled past the limit: uvloop runs due timers
        # before it reads what became readable meanwhile.
        channel._overdue(request_id, overdue)
        reply, frames = await asyncio.wait_for(future, 5)
        assert reply["ok"] and [bytes(f) for f in frames] == [b"in time"]

    run(test)


def test_a_lane_connected_by_another_process_than_the_worker_it_names_is_closed(run):
    async def test(channel, worker, heard):
        await until(lambda: not channel.lanes._unnamed and worker.lane.recv(1) == b"")
        assert b"w1" not in channel.lanes._lanes
        future = channel.submit(b"w1", protocol.OP_CALL, [b"request"], method="m", deadline=None)
        header, _ = worker.take_from_socket()
        worker.socket.send_multipart([protocol.reply(header["id"]), b"done"])
        await asyncio.wait_for(future, 5)

    run(test, pid_of=lambda peer: os.getpid() + 1)


def test_a_front_out_of_descriptors_accepts_the_lane_later_without_spinning(tmp_path, monkeypatch, caplog):
    failures = []

    def out_of_descriptors(sock):
        failures.append(sock)
        raise OSError(errno.EMFILE, "Too many open files")

    async def main():
        heard: list[bytes] = []
        front = FrontLanes(
            str(tmp_path / "lanes.sock"), lambda peer, frames: heard.append(peer), lambda p: None
        )
        front.start()
        monkeypatch.setattr(socket.socket, "accept", out_of_descriptors)
        lane = lanes.connect(front.path, b"w1")
        assert lane is not None, "queued in the backlog: the worker takes it for a lane"
        try:
            await asyncio.sleep(0.2)
            assert len(failures) == 1, "the listening socket is not watched while nothing can be accepted"
            monkeypatch.undo()
            assert lanes.send(lane, [protocol.reply(1), b"done"])
            await until(lambda: heard == [b"w1"])  # the worker's reply is read once it is accepted
        finally:
            lane.close()
            front.close()

    asyncio.run(main())
    assert sum("could not accept" in record.getMessage() for record in caplog.records) == 1


def test_a_lane_that_cannot_listen_leaves_the_socket_to_do_it_all(tmp_path):
    os.mkdir(tmp_path / "lanes.sock")  # where the lane socket would be

    async def main():
        channel = Channel(
            f"ipc://{tmp_path}/channel.sock", lambda *_: None, lanes_path=f"{tmp_path}/lanes.sock"
        )
        channel.start()
        try:
            assert channel.lanes_address is None
        finally:
            await channel.close()

    asyncio.run(main())


# -- the worker's inbox ---------------------------------------------------------------------


@pytest.fixture
def inbox(tmp_path):
    """An Inbox over a DEALER and one end of a lane; yields (inbox, front ROUTER, front's lane end)."""
    context = zmq.Context()
    front = context.socket(zmq.ROUTER)
    front.bind(f"ipc://{tmp_path}/inbox.sock")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"w1")
    dealer.connect(f"ipc://{tmp_path}/inbox.sock")
    dealer.send(b"hello")  # the ROUTER knows it from now on
    assert front.poll(5000) and front.recv_multipart() == [b"w1", b"hello"]
    front_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    worker_end.setblocking(False)
    closed: list[int] = []
    box = Inbox(dealer, worker_end, Holdings(batch_max=1), lambda frames: None, 1, 0.0, closed.append)
    box.closed = closed  # type: ignore[attr-defined]
    yield box, front, front_end
    front_end.close()
    if box.lane is not None:
        box.lane.close()
    dealer.close(linger=0)
    front.close(linger=0)
    context.term()


def call(request_id: int) -> list:
    return [protocol.header(protocol.OP_CALL, request_id, method="m"), b"body"]


def ids(messages) -> list[int]:
    return [msgpack.unpackb(header)["id"] for header, _ in messages]


def wait_ready(box: Inbox, want) -> list:
    waiter = protocol.Waiter(box.waited_on())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        ready = waiter.wait(100)
        if all(item in ready for item in want):
            return ready
    raise AssertionError("never ready")


def test_a_socket_message_is_taken_after_what_the_lane_held_before_it(inbox):
    box, front, front_end = inbox
    assert lanes.send(front_end, call(1))
    front.send_multipart([b"w1", protocol.header(protocol.OP_DROP, 2, model="m", lane=1)])
    wait_ready(box, [box.socket])
    assert ids(box.take([box.socket])) == [1, 2], "the drop only after the call sent before it"


def test_a_load_or_a_drop_waits_for_no_lane_that_never_idles(inbox):
    box, front, front_end = inbox
    for request_id in (1, 2):
        assert lanes.send(front_end, call(request_id))
    front.send_multipart([b"w1", protocol.header(protocol.OP_DROP, 3, model="m", lane=2)])
    ready = wait_ready(box, [box.lane_fd, box.socket])
    assert ids(box.take(ready)) == [1, 2, 3], "the drop now, after the calls sent before it"


def test_a_call_over_the_socket_is_not_overtaken_by_those_sent_after_it_over_the_lane(inbox):
    box, front, front_end = inbox
    assert lanes.send(front_end, call(1))
    header, body = call(2)
    front.send_multipart([b"w1", protocol.header(protocol.OP_CALL, 2, method="m", lane=1), body])
    wait_ready(box, [box.socket])
    for request_id in (3, 4):
        assert lanes.send(front_end, call(request_id))
    taken: list[int] = []
    while len(taken) < 4:
        taken += ids(box.take(wait_ready(box, [])))
    assert taken == [1, 2, 3, 4]


def test_a_model_that_batches_no_rows_takes_one_message_a_wake(inbox):
    box, front, front_end = inbox
    for request_id in (1, 2):
        assert lanes.send(front_end, call(request_id))
    ready = wait_ready(box, [box.lane_fd])
    assert ids(box.take(ready)) == [1]
    assert ids(box.take(wait_ready(box, [box.lane_fd]))) == [2]


def test_a_lane_the_front_keeps_full_does_not_hold_back_a_socket_message(inbox):
    box, front, front_end = inbox
    for request_id in (1, 2):
        assert lanes.send(front_end, call(request_id))
    front.send_multipart([b"w1", protocol.header(protocol.OP_DROP, 3, model="m", lane=2)])
    wait_ready(box, [box.socket])
    taken: list[int] = []
    for request_id in range(4, 10):  # each answer frees a slot, which the front fills at once
        taken += ids(box.take(wait_ready(box, [box.lane_fd])))
        assert lanes.send(front_end, call(request_id))
    assert 3 in taken, f"the drop never taken, only calls: {taken}"
    assert taken.index(3) == 2, "after the calls sent before it"


def test_a_worker_whose_lane_the_front_closed_goes_on_over_its_socket(inbox):
    box, front, front_end = inbox
    front_end.close()
    assert box.take(wait_ready(box, [box.lane_fd])) == []
    assert box.lane is None and box.waited_on() == [box.socket]
    assert len(box.closed) == 1, "the worker was told, to stop polling the descriptor"
    front.send_multipart([b"w1", *call(3)])
    assert ids(box.take(wait_ready(box, [box.socket]))) == [3]


# -- a runtime ------------------------------------------------------------------------------


def echo_row(runtime: Runtime) -> dict:
    rows = [row for row in cli.ask(runtime.env["RUNTIME_DIR"], "workers") if row["model"] == "echo"]
    assert len(rows) == 1, rows
    return rows[0]


def echo_call(runtime: Runtime, values: int) -> None:
    request = v2.ModelInferRequest(model_name="echo")
    request.inputs.add(name="x", datatype="FP32", shape=[1, values])
    request.raw_input_contents.append(np.arange(values, dtype=np.float32).tobytes())
    answer = runtime.infer.ModelInfer(request, metadata=mesh_headers("echo"), timeout=10)
    assert answer.raw_output_contents[0] == request.raw_input_contents[0]


def test_a_runtimes_small_calls_cross_its_lanes_and_the_rest_its_socket():
    with Runtime() as runtime:
        runtime.load("echo", runtime.model_dir("echo"))
        for _ in range(5):
            echo_call(runtime, 4)
        assert echo_row(runtime)["lane_messages"] == [5, 5], "the load and its reply: the socket"
        echo_call(runtime, lanes.LANE_MESSAGE_MAX // 4)  # too big for a lane, too small for a ring
        assert echo_row(runtime)["lane_messages"] == [5, 5]
        assert echo_row(runtime)["ring_frames"] is None
        runtime.unload("echo")
        assert "malformed" not in runtime.log() and "lane" not in runtime.log()


def test_a_runtime_without_lanes_serves_every_call_over_the_worker_socket(tmp_path):
    runtime = Runtime()
    os.makedirs(os.path.join(runtime.env["RUNTIME_DIR"], "lanes.sock"), mode=0o700)  # in the way
    with runtime:
        runtime.load("echo", runtime.model_dir("echo"))
        for values in (4, lanes.LANE_MESSAGE_MAX // 4):
            echo_call(runtime, values)
        assert echo_row(runtime)["lane_messages"] is None
        assert "no call lanes" in runtime.log()
