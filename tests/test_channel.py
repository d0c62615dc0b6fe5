"""runtime/channel.py against a hand-driven DEALER: request records, and when polling is worth it."""

from __future__ import annotations

import asyncio
import os

import msgpack
import pytest
import zmq

from runtime.channel import Channel, PeerGone
from workers import protocol
from workers.rings import RING_MIN_BYTES, WorkerRings


class FakeWorker:
    """A DEALER socket the test answers by hand."""

    def __init__(self, address: str, identity: bytes = b"w1"):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity)
        self.socket.connect(address)
        self.socket.send(protocol.header(protocol.OP_HELLO, pid=0))

    def take(self) -> dict:
        assert self.socket.poll(5000), "the front sent nothing"
        return msgpack.unpackb(self.socket.recv_multipart()[0])

    def answer(self, request_id: int, body: bytes = b"done") -> None:
        self.socket.send_multipart([protocol.reply(request_id), body])

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


async def until(condition, seconds: float = 5.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never held")


@pytest.fixture
def run(tmp_path):
    """Runs an async test with a started Channel and a connected FakeWorker."""

    def runner(test, busy_poll_seconds: float = 0.0, ring_bytes: int = 0, runs_at_once: int = 1):
        async def main():
            heard = []
            channel = Channel(
                f"ipc://{tmp_path}/channel.sock",
                lambda peer, header: heard.append(header["op"]),
                busy_poll_seconds,
                ring_bytes,
                runs_at_once,
            )
            channel.start()
            worker = FakeWorker(channel.address)
            try:
                await until(lambda: protocol.OP_HELLO in heard)
                await test(channel, worker)
            finally:
                worker.close()
                await channel.close()

        asyncio.run(main())

    return runner


def test_reply_resolves_the_future_with_its_payloads(run):
    async def test(channel, worker):
        future = channel.submit(b"w1", protocol.OP_CALL, [b"request"], method="m", deadline=None)
        header = worker.take()
        worker.answer(header["id"], b"response")
        reply, payloads = await asyncio.wait_for(future, 5)
        assert reply["ok"] and [bytes(p) for p in payloads] == [b"response"]

    run(test)


def test_a_cancelled_caller_keeps_the_request_until_the_worker_answers(run):
    async def test(channel, worker):
        ended = []
        future = channel.submit(
            b"w1", protocol.OP_CALL, [b"x"], on_end=lambda: ended.append(1), method="m", deadline=None
        )
        header = worker.take()
        future.cancel()
        await asyncio.sleep(0.05)
        assert ended == [], "the slot was freed while the worker still worked on the call"
        assert channel.replies_due_soon()
        worker.answer(header["id"])
        await until(lambda: ended == [1])

    run(test)


def test_polling_is_worth_it_only_without_queued_requests(run):
    async def test(channel, worker):
        assert not channel.replies_due_soon(), "nothing is owed"
        first = channel.submit(b"w1", protocol.OP_CALL, [b"1"], method="m", deadline=None)
        assert channel.replies_due_soon(), "one request, its worker runs it"
        second = channel.submit(b"w1", protocol.OP_CALL, [b"2"], method="m", deadline=None)
        assert not channel.replies_due_soon(), "a request queued behind another: the worker is saturated"
        worker.answer(worker.take()["id"])
        await first
        assert channel.replies_due_soon()
        worker.answer(worker.take()["id"])
        await second
        assert not channel.replies_due_soon()

    run(test)


def test_only_a_call_sets_the_loop_polling_for_its_reply(run):
    async def test(channel, worker):
        load = channel.submit(b"w1", protocol.OP_LOAD, model_id="a", format="python", path="/", pack=True)
        assert channel.replies_due_soon() and not channel.busy_poller.spinning, "a load answers in ms"
        worker.answer(worker.take()["id"])
        await load
        call = channel.submit(b"w1", protocol.OP_CALL, [b"x"], method="m", deadline=None)
        assert channel.busy_poller.spinning
        worker.answer(worker.take()["id"])
        await call

    run(test, busy_poll_seconds=0.01)


def test_overdue_request_ends_with_the_given_error(run):
    async def test(channel, worker):
        ended = []
        future = channel.submit(
            b"w1",
            protocol.OP_CALL,
            [b"x"],
            on_end=lambda: ended.append(1),
            overdue_after=0.05,
            on_overdue=lambda: TimeoutError("overdue"),
            method="m",
            deadline=None,
        )
        with pytest.raises(TimeoutError, match="overdue"):
            await asyncio.wait_for(future, 5)
        assert ended == [1]
        worker.answer(worker.take()["id"])  # a late answer is ignored
        await asyncio.sleep(0.05)

    run(test)


def overdue_call(channel, overdue_after: float) -> asyncio.Future:
    return channel.submit(
        b"w1",
        protocol.OP_CALL,
        [b"x"],
        overdue_after=overdue_after,
        on_overdue=lambda: TimeoutError("overdue"),
        method="m",
        deadline=None,
    )


def test_a_request_queued_behind_another_is_not_overdue_for_the_time_it_waited(run):
    async def test(channel, worker):
        first, second = overdue_call(channel, 0.5), overdue_call(channel, 0.5)
        await asyncio.sleep(0.3)
        worker.answer(worker.take()["id"])
        await first
        await asyncio.sleep(0.3)  # 0.6 s after it was sent, 0.3 s after its worker began it
        worker.answer(worker.take()["id"])
        await second

    run(test)


def test_a_worker_running_requests_at_once_begins_them_all(run):
    async def test(channel, worker):
        calls = [overdue_call(channel, 0.05) for _ in range(2)]
        for call in calls:
            with pytest.raises(TimeoutError, match="overdue"):
                await asyncio.wait_for(call, 5)

    run(test, runs_at_once=2)


def test_unknown_peer_fails_at_once_and_frees_the_slot(run):
    async def test(channel, worker):
        ended = []
        future = channel.submit(
            b"nobody", protocol.OP_CALL, [b"x"], on_end=lambda: ended.append(1), method="m", deadline=None
        )
        with pytest.raises(PeerGone):
            await future
        assert ended == [1] and not channel.replies_due_soon()

    run(test)


def test_dead_peer_fails_every_request_waiting_on_it(run):
    async def test(channel, worker):
        futures = [
            channel.submit(b"w1", protocol.OP_CALL, [b"x"], method="m", deadline=None) for _ in range(3)
        ]
        channel.fail_peer(b"w1", -9)
        for future in futures:
            with pytest.raises(PeerGone):
                await future
        assert not channel.replies_due_soon()

    run(test)


def test_a_reply_whose_payloads_are_not_in_a_ring_fails_its_call_instead_of_hanging(run):
    async def test(channel, worker):
        future = channel.submit(b"w1", protocol.OP_CALL, [b"request"], method="m", deadline=None)
        request_id = worker.take()["id"]
        lost = {"frames": [[0, 0, 1 << 20]]}  # this worker has no rings
        worker.socket.send_multipart([protocol.reply(request_id, ring=lost), b""])
        header, _ = await asyncio.wait_for(future, 5)
        assert header["ok"] is False and header["error"] == protocol.ERROR_PROTOCOL
        assert not channel.replies_due_soon()  # nothing left waiting on it

    run(test)


def test_big_frames_cross_in_the_ring_both_ways_once_the_worker_has_mapped_it(run):
    big, worker_rings = os.urandom(RING_MIN_BYTES), WorkerRings()

    def serve(worker, reply_payloads: list) -> tuple[dict, list]:
        """The fake worker takes one message, its payloads out of the ring, and answers."""
        assert worker.socket.poll(5000), "the front sent nothing"
        header, *payloads = worker.socket.recv_multipart()
        header = msgpack.unpackb(header)
        if "ring" in header:
            payloads = worker_rings.receive(header["ring"], payloads)
        frames = [protocol.reply(header["id"]), *reply_payloads]
        worker.socket.send_multipart(worker_rings.outgoing(frames) if worker_rings.in_use else frames)
        return header, payloads

    async def call(channel, worker, payload: bytes, reply_payloads: list) -> tuple[dict, list, list]:
        future = channel.submit(b"w1", protocol.OP_CALL, [payload], method="m", deadline=None)
        sent, received = serve(worker, reply_payloads)
        _, answer = await asyncio.wait_for(future, 5)
        return sent, received, [bytes(frame) for frame in answer]

    async def test(channel, worker):
        sent, received, _ = await call(channel, worker, big, [b"ok"])
        assert "offer" in sent["ring"] and received == [big]  # the first one over the socket
        assert channel.rings.frames(b"w1") == [0, 0]  # the worker said it mapped the ring

        sent, received, answer = await call(channel, worker, big, [b"head", big[::-1]])
        assert sent["ring"]["frames"] == [[0, 0, RING_MIN_BYTES]] and received == [big]
        assert answer == [b"head", big[::-1]]

        sent, received, _ = await call(channel, worker, b"small", [b"ok"])
        assert sent["ring"] == {"taken": RING_MIN_BYTES}  # the front said how far it had read
        assert received == [b"small"] and channel.rings.frames(b"w1") == [1, 1]

    run(test, ring_bytes=4 * RING_MIN_BYTES)
    assert worker_rings.pair is not None
    worker_rings.pair.close()
