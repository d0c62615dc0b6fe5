"""Big payload frames through shared memory (workers/rings.py, runtime/rings.py): the ring, the offer,
both sides in one process, and the runtime serving big calls through it and giving its pages back."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os

import msgpack
import numpy as np
import pytest
from harness import MiB, Runtime, mesh_headers, wait_until

from protos import grpc_predict_v2_pb2 as v2
from runtime import rings as front_rings
from runtime.admin import cli
from runtime.rings import FrontRings
from workers import protocol
from workers.loop import Worker
from workers.rings import RING_MIN_BYTES, Ring, RingError, RingPair, WorkerRings

# -- one ring ----------------------------------------------------------------------------


def test_a_frame_comes_out_as_it_went_in_and_the_next_starts_after_it():
    ring = Ring(memoryview(bytearray(100)))
    assert ring.put(b"a" * 30) == 0
    assert ring.put(b"b" * 30) == 30
    assert ring.take(0, 30) == b"a" * 30
    assert ring.take(30, 30) == b"b" * 30
    assert ring.taken == 60


def test_a_frame_never_wraps_and_waits_for_the_room_it_needs():
    ring = Ring(memoryview(bytearray(100)))
    ring.put(b"a" * 30)
    ring.put(b"b" * 30)
    ring.told_taken(30)
    assert ring.put(b"c" * 50) is None  # past the end: it must start at the first byte, still taken up
    ring.told_taken(60)
    assert ring.put(b"c" * 50) == 100  # the first byte again, one lap on
    assert ring.view[:50] == b"c" * 50


def test_once_everything_is_taken_the_next_frame_starts_at_the_first_byte_again():
    ring = Ring(memoryview(bytearray(100)))
    ring.put(b"a" * 30)
    ring.told_taken(30)
    assert ring.put(b"b" * 10) == 100  # the same pages again, not the next 10 bytes
    assert ring.put(b"c" * 10) == 110


def test_a_frame_goes_back_to_the_first_byte_as_soon_as_it_fits_there():
    ring = Ring(memoryview(bytearray(100)))
    ring.put(b"a" * 30)
    ring.put(b"b" * 30)
    ring.told_taken(30)  # "b" is still in flight at 30-59
    assert ring.put(b"c" * 20) == 100  # not 60: the pages at the start again
    assert ring.put(b"d" * 20) is None  # 120-139 would run into "b" one lap on
    ring.told_taken(60)
    assert ring.put(b"d" * 20) == 120


def test_an_empty_ring_has_all_its_room_whatever_came_before():
    ring = Ring(memoryview(bytearray(100)))
    for size in (10, 50, 100, 30, 100, 1, 99):  # one at a time, each taken before the next
        position = ring.put(b"x" * size)
        assert position is not None and position % 100 == 0, size
        assert ring.take(position, size) == b"x" * size
        ring.told_taken(ring.taken)


def test_a_frame_bigger_than_the_ring_or_than_its_room_does_not_fit():
    ring = Ring(memoryview(bytearray(100)))
    assert ring.put(b"x" * 101) is None
    ring.put(b"a" * 60)
    assert ring.put(b"b" * 60) is None
    assert ring.head == 60  # nothing was written


@pytest.mark.parametrize(
    "position, length",
    [(0, 10), (95, 10), ("0", 10), (60, -1), (60, True)],
    ids=["already-taken", "past-the-end", "not-a-number", "negative", "bool-length-is-an-int"],
)
def test_take_refuses_what_cannot_be_a_frame_in_the_ring(position, length):
    ring = Ring(memoryview(bytearray(100)))
    ring.taken = 50
    if length is True:  # msgpack never sends a bool for a length, but one is an int: a 1-byte frame
        assert ring.take(position, length) == b"\0"
        return
    with pytest.raises(RingError):
        ring.take(position, length)


def test_told_taken_must_lie_between_what_was_taken_and_what_was_put():
    ring = Ring(memoryview(bytearray(100)))
    ring.put(b"a" * 30)
    with pytest.raises(RingError):
        ring.told_taken(31)
    ring.told_taken(30)
    with pytest.raises(RingError):
        ring.told_taken(29)


def test_a_pair_opened_by_path_shares_its_bytes_and_giving_back_frees_them():
    pair, fd = RingPair.create(RING_MIN_BYTES)
    try:
        other = RingPair.open(f"/proc/{os.getpid()}/fd/{fd}", RING_MIN_BYTES)
        position = pair.to_worker.put(b"q" * RING_MIN_BYTES)
        assert other.to_worker.take(position, RING_MIN_BYTES) == b"q" * RING_MIN_BYTES
        pair.give_back()
        assert bytes(other.to_worker.view[:8]) == bytes(8)  # the pages are gone for both
        other.close()
        with pytest.raises(RingError):
            RingPair.open(f"/proc/{os.getpid()}/fd/{fd}", 2 * RING_MIN_BYTES)
    finally:
        os.close(fd)
        pair.close()


# -- both sides in one process ------------------------------------------------------------

BIG = RING_MIN_BYTES
PEER = b"w1"


def front_sends(front: FrontRings, payloads: list) -> tuple[dict, list]:
    """What the front's channel would send: the payloads and the header's ring field."""
    payloads, field = front.outgoing(PEER, payloads)
    return (field or {}), list(payloads)


def worker_replies(worker: WorkerRings, payloads: list) -> tuple[dict, list]:
    frames = worker.outgoing([protocol.reply(1), *payloads]) if worker.in_use else None
    if frames is None:
        return {}, payloads
    return msgpack.unpackb(frames[0]).get("ring", {}), frames[1:]


def test_the_front_offers_with_its_first_big_frame_then_big_frames_cross_in_the_ring():
    async def main():
        front = FrontRings(4 * BIG, is_busy=lambda peer: False)
        worker = WorkerRings()
        request = os.urandom(BIG)
        field, payloads = front_sends(front, [request])
        assert "offer" in field and payloads == [request]  # the first goes over the socket
        assert worker.receive(field, payloads) == [request]
        field, frames = worker_replies(worker, [b"small"])
        assert field == {"accepted": True}
        front.incoming(PEER, field, frames)

        field, payloads = front_sends(front, [request])
        assert payloads == [b""] and field["frames"] == [[0, 0, BIG]]
        assert worker.receive(field, payloads) == [request]
        response = os.urandom(2 * BIG)
        field, frames = worker_replies(worker, [b"head", response])
        assert field["taken"] == BIG and field["frames"] == [[1, 0, 2 * BIG]]
        assert frames == [b"head", b""]
        assert front.incoming(PEER, field, frames) == [b"head", response]
        assert front.owed == {PEER}

        field, payloads = front_sends(front, [b"small"])  # the front says what it took
        assert field == {"taken": 2 * BIG} and payloads == [b"small"]
        worker.receive(field, payloads)
        assert worker.pair is not None and worker.pair.to_front.tail == 2 * BIG

        floats = np.arange(BIG // 4, dtype=np.float32)  # a view counts elements; the ring, bytes
        field, frames = worker_replies(worker, [b"head", memoryview(floats)])
        assert field["frames"] == [[1, 4 * BIG, BIG]]  # all taken: the first byte again, one lap on
        assert front.incoming(PEER, field, frames)[1] == floats.tobytes()
        front.close()
        worker.pair.close()

    asyncio.run(main())


def test_a_reply_with_nothing_for_the_ring_is_handed_back_as_it_was():
    # The worker sends a reply over its call lane only if outgoing() gave back the very list it got
    # (workers/loop.py): one that names no ring, as most replies of a worker with rings.
    async def main():
        front = FrontRings(4 * BIG, is_busy=lambda peer: False)
        worker = WorkerRings()
        field, payloads = front_sends(front, [os.urandom(BIG)])
        worker.receive(field, payloads)
        accepting = [protocol.reply(1), b"small"]
        assert worker.outgoing(accepting) is not accepting, "it says it accepted the offer"
        big = [protocol.reply(2), os.urandom(BIG)]
        assert worker.outgoing(big) is not big
        small = [protocol.reply(3), b"small"]
        assert worker.outgoing(small) is small
        front.close()
        assert worker.pair is not None
        worker.pair.close()

    asyncio.run(main())


def test_a_worker_that_cannot_map_the_offer_keeps_to_the_socket_and_is_not_asked_again():
    front = FrontRings(4 * BIG, is_busy=lambda peer: False)
    worker = WorkerRings()
    field, payloads = front_sends(front, [bytes(BIG)])
    field["offer"][0] = "/proc/self/fd/999999"  # a path the worker cannot open
    worker.receive(field, payloads)
    field, frames = worker_replies(worker, [b"x"])
    assert "refused" in field and worker.pair is None
    front.incoming(PEER, field, frames)
    assert front_sends(front, [bytes(BIG)]) == ({}, [bytes(BIG)])
    front.close()


@pytest.mark.parametrize("answer", [{"accepted": False}, {"accepted": "yes"}, {"refused": None}])
def test_an_answer_that_is_not_plainly_accepted_counts_as_a_refusal(answer):
    front = FrontRings(4 * BIG, is_busy=lambda peer: False)
    front_sends(front, [bytes(BIG)])
    front.incoming(PEER, answer, [])
    assert front_sends(front, [bytes(BIG)]) == ({}, [bytes(BIG)])  # the socket, for good
    front.close()


@pytest.mark.parametrize(
    "lengths",
    [[4 * BIG] * 3, [4 * BIG, 4 * BIG, -4 * BIG], [BIG, -BIG, 4 * BIG]],
    ids=["whole-ring-frames", "a-negative-length-to-balance-them", "a-negative-length-first"],
)
def test_a_message_never_has_more_than_a_ring_copied_out_of_the_ring(lengths):
    front = FrontRings(4 * BIG, is_busy=lambda peer: False)
    front_sends(front, [bytes(BIG)])
    front.incoming(PEER, {"accepted": True}, [])
    copies = []
    ring = front._pairs[PEER].to_front
    ring.take = lambda position, length: copies.append(length) or b"x"  # type: ignore[method-assign]
    frames = [[index, index * 4 * BIG, length] for index, length in enumerate(lengths)]
    with pytest.raises(RingError):
        front.incoming(PEER, {"frames": frames}, [b""] * len(frames))
    assert sum(copies) <= 4 * BIG and all(length >= 0 for length in copies)
    front.close()


def test_while_a_worker_holds_calls_its_ring_is_looked_at_once_a_period_not_more(monkeypatch):
    monkeypatch.setattr(front_rings, "QUIET_SECONDS", 0.05)

    async def main():
        front = FrontRings(4 * BIG, is_busy=lambda peer: True)
        front.outgoing(PEER, [bytes(BIG)])
        front.incoming(PEER, {"accepted": True}, [])
        front.outgoing(PEER, [bytes(BIG)])
        looks = []
        give_back = front._give_back
        front._give_back = lambda: looks.append(1) or give_back()  # type: ignore[method-assign]
        await asyncio.sleep(0.5)  # ten periods
        front.close()
        return len(looks)

    assert asyncio.run(main()) <= 11


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("answer", ["accepted", "refused", "none: the worker died"])
def test_the_offered_memfd_is_closed_whatever_became_of_the_offer(answer):
    async def main():
        front = FrontRings(4 * BIG, is_busy=lambda peer: False)
        before = open_fds()
        assert "offer" in front_sends(front, [bytes(BIG)])[0]
        assert open_fds() == before + 1  # the memfd, until the worker says whether it mapped it
        if answer == "accepted":
            front.incoming(PEER, {"accepted": True}, [])
        elif answer == "refused":
            front.incoming(PEER, {"refused": "no /proc"}, [])
        else:
            front.forget(PEER)
        assert open_fds() == before
        front.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    "field",
    [{"frames": [[0, 0, 10]]}, {"taken": 5}, ["not", "a", "map"]],
    ids=["frames-without-a-ring", "taken-without-a-ring", "not-a-map"],
)
def test_ring_fields_that_describe_nothing_are_protocol_errors(field):
    with pytest.raises(RingError):
        WorkerRings().receive(field, [b""])
    with pytest.raises(RingError):
        FrontRings(BIG, is_busy=lambda peer: False).incoming(PEER, field, [b""])


def test_pages_go_back_once_big_frames_stop_and_only_for_workers_holding_no_call(monkeypatch):
    monkeypatch.setattr(front_rings, "QUIET_SECONDS", 0.05)

    async def main():
        busy = {b"w1", b"w2"}
        front = FrontRings(4 * BIG, is_busy=lambda peer: peer in busy)
        pairs = {}
        for peer in (b"w1", b"w2"):
            front.outgoing(peer, [bytes(BIG)])  # the offer
            pair, _ = front._offers[peer]
            front.incoming(peer, {"accepted": True}, [])
            pairs[peer] = pair
            front.outgoing(peer, [b"\x01" * BIG])  # in the ring now
        busy.discard(b"w1")
        await asyncio.sleep(0.2)
        assert bytes(pairs[b"w1"].to_worker.view[:4]) == bytes(4)  # given back
        assert bytes(pairs[b"w2"].to_worker.view[:4]) == b"\x01" * 4  # its call still runs
        busy.clear()
        await asyncio.sleep(0.2)
        assert bytes(pairs[b"w2"].to_worker.view[:4]) == bytes(4)
        front.close()

    asyncio.run(main())


def test_a_quiet_worker_gets_its_pages_back_while_another_keeps_sending_big_frames(monkeypatch):
    monkeypatch.setattr(front_rings, "QUIET_SECONDS", 0.05)

    async def main():
        front = FrontRings(4 * BIG, is_busy=lambda peer: False)
        pairs = {}
        for peer in (b"w1", b"w2"):
            front.outgoing(peer, [bytes(BIG)])  # the offer
            pairs[peer] = front._offers[peer][0]
            front.incoming(peer, {"accepted": True}, [])
            front.outgoing(peer, [b"\x01" * BIG])
        for _ in range(15):  # w2's big frames go on, never quiet for a period
            await asyncio.sleep(0.02)
            front.incoming(b"w2", {"taken": pairs[b"w2"].to_worker.head}, [])
            front.outgoing(b"w2", [b"\x02" * BIG])
        assert bytes(pairs[b"w1"].to_worker.view[:4]) == bytes(4)  # given back meanwhile
        assert bytes(pairs[b"w2"].to_worker.view[:4]) != bytes(4)
        front.close()

    asyncio.run(main())


def test_a_kernel_that_refuses_to_free_the_pages_costs_a_warning_not_the_front(monkeypatch, caplog):
    monkeypatch.setattr(front_rings, "QUIET_SECONDS", 0.05)

    def refuse(self):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(RingPair, "give_back", refuse)

    async def main():
        front = FrontRings(4 * BIG, is_busy=lambda peer: False)
        front.outgoing(PEER, [bytes(BIG)])
        front.incoming(PEER, {"accepted": True}, [])
        for _ in range(2):  # two bursts: one warning, and no timer left over
            assert "frames" in front.outgoing(PEER, [bytes(BIG)])[1]
            await asyncio.sleep(0.2)
        assert front._give_back_timer is None
        front.close()

    asyncio.run(main())
    assert [r.message for r in caplog.records].count(
        "ring pages stay until their worker exits: cannot give them back ([Errno 22] Invalid argument)"
    ) == 1


def test_a_call_whose_payload_is_not_in_the_ring_fails_with_a_protocol_error(tmp_path):
    worker = Worker(
        {"address": f"ipc://{tmp_path}/unit.sock", "identity": b"unit", "heartbeat_timeout": 1, "threads": 1}
    )
    sent = []
    worker.send = lambda frames: sent.append(msgpack.unpackb(frames[0]))
    header = protocol.header(
        protocol.OP_CALL,
        9,
        model="m",
        method=protocol.METHOD_INFER,
        deadline=None,
        ring={"frames": [[0, 0, 8]]},
    )
    worker.handle([(header, [memoryview(b"")])])
    assert sent and sent[0]["id"] == 9 and sent[0]["error"] == protocol.ERROR_PROTOCOL
    worker.socket.close(linger=0)
    worker.context.term()


# -- the runtime ---------------------------------------------------------------------------


def echo_request(values: int, first: int) -> v2.ModelInferRequest:
    request = v2.ModelInferRequest(model_name="echo")
    request.inputs.add(name="x", datatype="FP32", shape=[1, values])
    request.raw_input_contents.append(np.arange(first, first + values, dtype=np.float32).tobytes())
    return request


def ring_pages(pid: int) -> int:
    """Bytes of the process's mappings of rings that are resident (/proc/PID/smaps)."""
    total, in_ring = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            if "-" in line.split(" ", 1)[0]:  # a mapping's first line
                in_ring = "memfd:mesh-ring" in line
            elif in_ring and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def rings_mapped(pid: int) -> int:
    with open(f"/proc/{pid}/maps") as maps:
        return sum("memfd:mesh-ring" in line for line in maps)


def ring_frames(runtime: Runtime) -> list[int] | None:
    """[frames sent to, received from] the echo worker through its rings (inspect-workers' rows)."""
    rows = [row for row in cli.ask(runtime.env["RUNTIME_DIR"], "workers") if row["model"] == "echo"]
    assert len(rows) == 1, rows
    return rows[0]["ring_frames"]


def big_echoes_in_parallel(runtime: Runtime, calls: int, values: int, first: int = 0) -> None:
    requests = [echo_request(values, first + call) for call in range(calls)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda request: runtime.infer.ModelInfer(request, metadata=mesh_headers("echo"), timeout=30),
                requests,
            )
        )
    for request, answer in zip(requests, answers, strict=True):
        assert answer.raw_output_contents[0] == request.raw_input_contents[0]


def test_big_calls_cross_in_the_ring_come_back_whole_and_its_pages_go_back_once_they_stop():
    with Runtime() as runtime:
        runtime.load("echo", runtime.model_dir("echo"))
        worker = runtime.worker_for("echo")
        assert worker is not None
        # One at a time, each side has said it took the last frame before the next is sent: every
        # frame fits, but the first request's, which goes over the socket with the offer.
        for first in range(4):
            big_echoes_in_parallel(runtime, 1, MiB // 4, first)
        assert rings_mapped(runtime.pid) == 1 and rings_mapped(worker.pid) == 1
        assert ring_frames(runtime) == [3, 4]
        # Many at once, a frame that finds the ring full goes over the socket: how many do depends
        # on how the two processes interleave, and every call still comes back whole.
        big_echoes_in_parallel(runtime, 24, MiB // 4)
        to_worker, to_front = ring_frames(runtime)
        assert 3 < to_worker <= 3 + 24 and 4 < to_front <= 4 + 24
        wait_until(
            lambda: ring_pages(runtime.pid) == 0 and ring_pages(worker.pid) == 0,
            timeout=10,
            what="the ring's pages to go back",
        )
        big_echoes_in_parallel(runtime, 4, MiB // 4)  # and it serves on after that
        os.kill(worker.pid, 9)
        wait_until(lambda: rings_mapped(runtime.pid) == 0, timeout=10, what="the dead worker's ring to go")


@pytest.mark.parametrize(
    "settings, crossed",
    [
        ({"SHARED_RING_BYTES": "0"}, None),
        ({"SHARED_RING_BYTES": str(RING_MIN_BYTES)}, [0, 0]),
        ({"WORKER_THREADS": "2"}, "some each way"),
    ],
    ids=["no-ring", "frames-bigger-than-the-ring", "call-threads"],
)
def test_big_calls_come_back_whole_however_the_ring_is_set(settings, crossed):
    with Runtime(**settings) as runtime:
        runtime.load("echo", runtime.model_dir("echo"))
        big_echoes_in_parallel(runtime, 12, MiB // 4)
        assert rings_mapped(runtime.pid) == (0 if crossed is None else 1)
        frames = ring_frames(runtime)
        if crossed == "some each way":
            assert frames is not None and frames[0] > 0 and frames[1] > 0, frames
        else:
            assert frames == crossed
