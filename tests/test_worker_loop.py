"""The worker's call handling, in-process: deadlines, error kinds, raw frames out, its loop, its beats."""

import errno
import os
import subprocess
import threading
import time

import msgpack
import numpy as np
import pytest
import zmq

from plumbing import lifeline
from protos import grpc_predict_v2_pb2 as v2
from protos import wire
from runtime.beats import BeatFile
from workers import protocol, raised
from workers.holding import Held
from workers.loop import Worker


def hold(worker, model, fmt="python", batches_rows=False):
    """Gives the worker `model` as model "m", as a load would."""
    worker.models.by_id = {"m": Held("m", fmt, model, batches_rows)} if model is not None else {}
    worker.models.batches_rows = batches_rows


class CountingModel:
    handles_methods = False

    def __init__(self):
        self.calls = 0

    def predict(self, inputs, parameters, requested_outputs):
        self.calls += 1
        if "boom" in inputs:
            raise ZeroDivisionError("boom")
        return {"y": inputs["x"] * 2}

    def metadata(self):
        return None


@pytest.fixture
def worker(tmp_path):
    worker = Worker(
        {"address": f"ipc://{tmp_path}/unit.sock", "identity": b"unit", "heartbeat_timeout": 1, "threads": 1}
    )
    hold(worker, CountingModel())
    yield worker
    worker.socket.close(linger=0)
    worker.context.term()


def raw_request(name="x"):
    request = v2.ModelInferRequest(model_name="m")
    request.inputs.add(name=name, datatype="FP32", shape=[2])
    request.raw_input_contents.append(np.array([1.5, 2.0], dtype=np.float32).tobytes())
    return request.SerializeToString()


def call(worker, body, method=protocol.METHOD_INFER, deadline=None):
    header = {
        "v": protocol.PROTOCOL_VERSION,
        "op": protocol.OP_CALL,
        "id": 7,
        "method": method,
        "deadline": deadline,
    }
    reply = worker.on_call(header, [memoryview(body)])
    return msgpack.unpackb(reply[0]), reply[1:]


@pytest.mark.parametrize("request_id", [0, 1, 127, 128, 255, 256, 65536, 2**32, 2**62])
def test_a_reply_packer_packs_what_reply_packs(request_id):
    packed = protocol.reply_packer(append_field=6)
    assert packed(request_id) == protocol.reply(request_id, append_field=6)
    assert protocol.parse_header(packed(request_id))["id"] == request_id


def test_expired_call_is_dropped_without_running(worker):
    header, _ = call(worker, raw_request(), deadline=time.time() - 0.01)
    assert header["ok"] is False and header["error"] == protocol.ERROR_EXPIRED
    assert worker.models.by_id["m"].model.calls == 0


def test_raw_outputs_travel_as_their_own_frames(worker):
    header, frames = call(worker, raw_request(), deadline=time.time() + 10)
    assert header["ok"] and header["id"] == 7 and header["append_field"] == 6
    body, raw_output = frames
    assert np.frombuffer(raw_output, dtype=np.float32).tolist() == [3.0, 4.0]
    joined = bytes(body) + wire.bytes_field_header(6, len(raw_output)) + bytes(raw_output)
    response = v2.ModelInferResponse.FromString(joined)
    assert response.outputs[0].name == "y" and len(response.raw_output_contents) == 1


@pytest.mark.parametrize(
    "body, method, kind",
    [
        (b"\xff\xff", protocol.METHOD_INFER, protocol.ERROR_INVALID_INPUT),
        (None, protocol.METHOD_INFER, protocol.ERROR_MODEL),
        (b"", "acme.Scorer/Score", protocol.ERROR_UNIMPLEMENTED),
    ],
    ids=["malformed", "model-raises", "no-handle"],
)
def test_error_kinds(worker, body, method, kind):
    header, _ = call(worker, raw_request("boom") if body is None else body, method)
    assert header["ok"] is False and header["error"] == kind


def test_call_without_a_model(worker):
    hold(worker, None)
    header, _ = call(worker, raw_request())
    assert header["error"] == protocol.ERROR_NOT_LOADED


def test_each_reply_leaves_before_the_next_queued_call_runs(worker):
    """Calls that were queued together are answered one by one, not all at the end."""
    events = []
    worker.send = lambda frames: events.append(("sent", msgpack.unpackb(frames[0])["id"]))
    predict = worker.models.by_id["m"].model.predict
    worker.models.by_id["m"].model.predict = lambda *args: (events.append(("ran", None)), predict(*args))[1]
    messages = []
    for request_id in (1, 2):
        header = msgpack.packb(
            {
                "v": protocol.PROTOCOL_VERSION,
                "op": protocol.OP_CALL,
                "id": request_id,
                "method": protocol.METHOD_INFER,
                "deadline": None,
            }
        )
        messages.append((header, [memoryview(raw_request())]))
    worker.handle(messages)
    assert events == [("ran", None), ("sent", 1), ("ran", None), ("sent", 2)]


@pytest.mark.parametrize("elements", [2, protocol.COPY_BELOW], ids=["small", "at-copy-threshold"])
def test_raw_request_decodes_alike_below_and_above_the_copy_threshold(worker, elements):
    """Small requests are parsed whole; big ones keep their tensors as views of the received frame."""
    values = np.arange(elements, dtype=np.float32)
    request = v2.ModelInferRequest(model_name="m")
    request.inputs.add(name="x", datatype="FP32", shape=[1, elements])
    request.raw_input_contents.append(values.tobytes())
    frame = memoryview(request.SerializeToString())
    call = worker._decode(7, frame)
    assert call.raw and call.inputs["x"].shape == (1, elements)
    assert np.array_equal(call.inputs["x"][0], values)
    big = len(frame) >= protocol.COPY_BELOW
    assert np.shares_memory(call.inputs["x"], np.frombuffer(frame, dtype=np.uint8)) == big


def test_handle_returning_anything_but_bytes_is_a_model_error(worker):
    """Answered as the model's error, instead of the worker dying on sending a str."""

    class TextHandler(CountingModel):
        handles_methods = True

        def handle(self, method, request):
            return "not bytes"

    hold(worker, TextHandler())
    header, _ = call(worker, b"", "acme.Scorer/Score")
    assert header["ok"] is False and header["error"] == protocol.ERROR_MODEL
    assert "handle() returned str, expected bytes" in header["message"]


@pytest.fixture
def stand_in_front():
    """A process that stands for the front: the worker checks that it runs, the test ends it."""
    process = subprocess.Popen(["sleep", "60"])
    yield process
    process.kill()
    process.wait()


def serving_worker(tmp_path, front, **config):
    """A Worker on a ROUTER the test holds, serving in a thread once its hello came."""
    address = f"ipc://{tmp_path}/serve.sock"
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    worker = Worker(
        {
            "address": address,
            "identity": b"unit",
            "front": lifeline.process_identity(front.pid),
            **config,
        }
    )
    hold(worker, CountingModel())
    serving = threading.Thread(target=worker.serve, daemon=True)
    serving.start()
    peer, hello = router.recv_multipart()
    assert protocol.parse_header(hello)["op"] == protocol.OP_HELLO
    return worker, serving, router, peer


def stop_serving(worker, serving, router):
    router.close(linger=0)
    router.context.term()
    serving.join(timeout=5)
    worker.socket.close(linger=0)
    if worker.pool is not None:
        worker.pool.shutdown()
        worker.replies.close(linger=0)
    worker.context.term()


@pytest.mark.parametrize("threads", [1, 2])
def test_serve_answers_calls_queued_together_beats_while_idle_and_ends_with_its_front(
    tmp_path, stand_in_front, threads
):
    beats = BeatFile(str(tmp_path))
    slot = beats.allocate()
    worker, serving, router, peer = serving_worker(
        tmp_path,
        stand_in_front,
        heartbeat_timeout=0.5,
        threads=threads,
        beats=beats.path,
        beat_slot=slot,
        beat_ms=50,
    )
    try:
        for request_id in (1, 2, 3):  # sent back to back: the worker may find them queued together
            router.send_multipart(
                [
                    peer,
                    protocol.header(protocol.OP_CALL, request_id, method=protocol.METHOD_INFER),
                    raw_request(),
                ]
            )
        answered = [protocol.parse_header(router.recv_multipart()[1]) for _ in range(3)]
        # In order with one thread; with a pool, replies leave as their calls finish.
        assert sorted((reply["id"], reply["ok"]) for reply in answered) == [(1, True), (2, True), (3, True)]
        stamps = []
        for _ in range(3):
            time.sleep(0.2)  # four beat intervals with nothing sent
            stamps.append(beats.last_beat(slot))
        assert stamps[0] < stamps[1] < stamps[2], "the idle worker stopped beating"
        assert time.monotonic() - stamps[2] < 1.0, "the beat is not the worker's time.monotonic()"
        assert not router.poll(0), "the worker sent something while idle"
        stand_in_front.kill()
        stand_in_front.wait()
        serving.join(timeout=5)
        assert not serving.is_alive(), "the worker kept serving after its front was gone"
    finally:
        stop_serving(worker, serving, router)
        beats.close()


def no_pidfd(pid):
    raise OSError(errno.ENOSYS, "pidfd_open")


@pytest.mark.parametrize("watch", ["pidfd", "proc"])
def test_serve_waits_for_a_silent_front_that_still_runs_and_exits_once_it_is_gone(
    tmp_path, stand_in_front, monkeypatch, watch
):
    # The front sends an idle worker nothing: only the front's end may end the worker.
    if watch == "proc":  # a kernel or seccomp profile without pidfd_open
        monkeypatch.setattr(os, "pidfd_open", no_pidfd)
    worker, serving, router, _ = serving_worker(
        tmp_path, stand_in_front, heartbeat_timeout=0.5, threads=1, beat_ms=100
    )
    assert (worker.front_watch.pidfd is not None) == (watch == "pidfd")
    try:
        serving.join(timeout=2.5)
        assert serving.is_alive(), "the worker left a front that was silent but still running"
        stand_in_front.kill()
        stand_in_front.wait()
        serving.join(timeout=5)
        assert not serving.is_alive(), "the worker kept waiting for a front that is gone"
    finally:
        stop_serving(worker, serving, router)


@pytest.fixture
def wired(tmp_path):
    """A worker of a row-wise model on a ROUTER the test holds (not serving: the test drives it)."""
    address = f"ipc://{tmp_path}/wired.sock"
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(address)
    worker = Worker(
        {"address": address, "identity": b"unit", "heartbeat_timeout": 1, "batch_max": 4, "batch_wait": 0.001}
    )
    hold(worker, CountingModel(), fmt="sklearn", batches_rows=True)
    handled: list[int] = []
    worker.socket.send(b"")  # the router learns the worker's identity from its first message
    router.recv_multipart()
    yield worker, router, handled
    router.close(linger=0)
    worker.socket.close(linger=0)
    worker.context.term()


def send_call(worker, router, request_id, unanswered=8):
    """Sends the worker a call and returns once it can be read there; `unanswered` as the front counts."""
    header = protocol.header(
        protocol.OP_CALL,
        request_id,
        model="m",
        method=protocol.METHOD_INFER,
        deadline=None,
        unanswered=unanswered,
    )
    router.send_multipart([b"unit", header, raw_request()])
    assert worker.waiter.wait(5000), "the call never reached the worker"


def receive_queued(worker, handled):
    """What the worker's loop does when its poll finds the socket readable (the lane idle)."""
    handled.append(len(worker.inbox.take([worker.socket])))


def receive_while_a_call_arrives(worker, router, request_id, handled):
    """receive_queued() with a fake sleep during which call `request_id` arrives; what it slept."""
    slept = []

    def a_call_arrives_meanwhile(seconds):
        slept.append(seconds)
        send_call(worker, router, request_id)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "sleep", a_call_arrives_meanwhile)
        receive_queued(worker, handled)
    return slept


def test_after_calls_that_came_together_the_worker_waits_for_one_more(wired):
    worker, router, handled = wired
    worker.inbox.last_batch = 2
    send_call(worker, router, 1)
    assert receive_while_a_call_arrives(worker, router, 2, handled) == [0.001]
    assert handled == [2] and worker.inbox.last_batch == 2


@pytest.mark.parametrize(
    "last_batch, unanswered, wait, batch_max",
    [(1, 8, 0.001, 4), (2, 2, 0.001, 4), (2, 8, 0.0, 4), (2, 8, 0.001, 1)],
    ids=["a call alone before", "the front has one more", "waiting off", "batch full"],
)
def test_the_worker_does_not_wait_when_nothing_says_a_call_is_coming(
    wired, monkeypatch, last_batch, unanswered, wait, batch_max
):
    worker, router, handled = wired
    inbox = worker.inbox
    inbox.last_batch, inbox.batch_wait, inbox.batch_max = last_batch, wait, batch_max
    send_call(worker, router, 1, unanswered)
    monkeypatch.setattr(time, "sleep", lambda seconds: pytest.fail(f"slept {seconds}"))
    receive_queued(worker, handled)
    assert handled == [1] and inbox.last_batch == 1


def test_a_worker_with_call_threads_never_waits_for_a_batch(tmp_path):
    worker = Worker(
        {
            "address": f"ipc://{tmp_path}/threads.sock",
            "identity": b"unit",
            "heartbeat_timeout": 1,
            "threads": 2,
            "batch_max": 4,
            "batch_wait": 0.001,
        }
    )
    try:
        assert worker.inbox.batch_wait == 0, "call threads do not batch"
    finally:
        assert worker.pool is not None
        worker.pool.shutdown()
        worker.replies.close(linger=0)
        worker.socket.close(linger=0)
        worker.context.term()


def test_calls_that_come_together_now_wait_for_one_more_too(wired):
    worker, router, handled = wired
    send_call(worker, router, 1)
    send_call(worker, router, 2)
    # send_call() returns once a call can be read, which the first already could: ZeroMQ's I/O
    # thread delivers the second a moment later, and the test needs both queued.
    time.sleep(0.2)
    assert receive_while_a_call_arrives(worker, router, 3, handled) == [0.001]
    assert handled == [3]


def test_after_the_wait_in_vain_the_call_runs_alone_and_the_next_does_not_wait(wired, monkeypatch):
    worker, router, handled = wired
    worker.inbox.last_batch = 3
    send_call(worker, router, 1)
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    receive_queued(worker, handled)
    send_call(worker, router, 2)
    receive_queued(worker, handled)
    assert slept == [0.001] and handled == [1, 1]


def test_a_model_raising_in_every_call_is_logged_once_a_while_with_a_count(worker, caplog, monkeypatch):
    boom = v2.ModelInferRequest(model_name="m")
    boom.inputs.add(name="boom", datatype="FP32", shape=[1]).contents.fp32_contents.append(1)
    with caplog.at_level("ERROR", logger="mesh.worker"):
        for _ in range(5):
            assert call(worker, boom.SerializeToString())[0]["error"] == protocol.ERROR_MODEL
        monkeypatch.setattr(raised, "REPEAT_SECONDS", 0.0)
        call(worker, boom.SerializeToString())
    said = [(r.getMessage(), r.exc_info is not None) for r in caplog.records]
    assert said == [
        ("model m raised while serving " + protocol.METHOD_INFER, True),
        (
            "model m raised while serving " + protocol.METHOD_INFER + "; 4 calls raised ZeroDivisionError "
            "since it was last logged",
            True,
        ),
    ]


def test_another_kind_of_exception_is_logged_at_once(worker, caplog):
    boom = v2.ModelInferRequest(model_name="m")
    boom.inputs.add(name="boom", datatype="FP32", shape=[1]).contents.fp32_contents.append(1)
    with caplog.at_level("ERROR", logger="mesh.worker"):
        call(worker, boom.SerializeToString())
        hold(worker, None)
        worker.models.by_id = {"m": Held("m", "python", object(), False)}  # predict: AttributeError
        call(worker, raw_request())
    assert [r.exc_info[0] for r in caplog.records] == [ZeroDivisionError, AttributeError]
