"""Calls queued together share one predict on row-wise models (workers/batching.py, Worker.replies_as_made).

In-process: a Worker whose socket nobody serves, handed the calls the way
the inbox hands them over. The end-to-end check with scikit-learn is
at the bottom.
"""

import concurrent.futures
import os
import time

import msgpack
import numpy as np
import pytest

from protos import grpc_predict_v2_pb2 as v2
from protos import wire
from runtime.replicas import PIPELINE_DEPTH, slots_per_worker
from workers import batching, protocol
from workers.holding import Held
from workers.loop import Worker


def hold(worker, model, fmt="python", batches_rows=False):
    """Gives the worker `model` as model "m", as a load would."""
    worker.models.by_id = {"m": Held("m", fmt, model, batches_rows)} if model is not None else {}
    worker.models.batches_rows = batches_rows


class RowModel:
    """Doubles each row; remembers the rows of every predict; rows holding 666 make it raise."""

    handles_methods = False

    def __init__(self, per_row: bool = True):
        self.batches: list[int] = []
        self.per_row = per_row

    def predict(self, inputs, parameters, requested_outputs):
        x = inputs["x"]
        self.batches.append(x.shape[0])
        if (x == 666).any():
            raise ValueError("poisoned row")
        if not self.per_row:
            return {"y": np.asarray([x.sum()])}  # one value for the whole input
        return {"y": x * 2}

    def metadata(self):
        return None


@pytest.fixture
def worker(tmp_path):
    worker = Worker(
        {
            "address": f"ipc://{tmp_path}/batch.sock",
            "identity": b"unit",
            "heartbeat_timeout": 1,
            "threads": 1,
            "batch_max": 8,
        }
    )
    hold(worker, RowModel(), "sklearn", batches_rows=True)
    yield worker
    worker.socket.close(linger=0)
    worker.context.term()


def request(rows, raw=False, datatype="FP32", outputs=()):
    array = np.asarray(rows, dtype=np.float32 if datatype == "FP32" else np.float64)
    message = v2.ModelInferRequest(model_name="m")
    tensor = message.inputs.add(name="x", datatype=datatype, shape=array.shape)
    if raw:
        message.raw_input_contents.append(array.tobytes())
    elif datatype == "FP32":
        tensor.contents.fp32_contents.extend(array.ravel())
    else:
        tensor.contents.fp64_contents.extend(array.ravel())
    for name in outputs:
        message.outputs.add(name=name)
    return message.SerializeToString()


def calls(*bodies, deadline=None):
    return [
        (
            {
                "v": protocol.PROTOCOL_VERSION,
                "op": protocol.OP_CALL,
                "id": 100 + i,
                "method": protocol.METHOD_INFER,
                "deadline": deadline,
            },
            [memoryview(body)],
        )
        for i, body in enumerate(bodies)
    ]


def in_order(worker, queued):
    """The replies to calls queued together, in the calls' order."""
    replies = dict(worker.replies_as_made(queued))
    return [replies[header["id"]] for header, _ in queued]


def test_each_groups_replies_come_as_soon_as_it_is_predicted(worker):
    # The front times a call from when its worker begins it: when the reply before it comes.
    model = worker.models.by_id["m"].model
    replies = worker.replies_as_made(calls(request([[1, 2]]), request([[3, 4]], outputs=["y"])))
    first_id, _ = next(replies)
    assert model.batches == [1]  # the other group (another output asked for) is not predicted yet
    assert [request_id for request_id, _ in replies] != [first_id] and model.batches == [1, 1]


def answers(replies):
    """[(ok, error kind, values of output y)] of the replies."""
    out = []
    for frames in replies:
        header = msgpack.unpackb(frames[0])
        if not header["ok"]:
            out.append((False, header["error"], None))
            continue
        body = bytes(frames[1]) + b"".join(
            wire.bytes_field_header(header["append_field"], len(f)) + bytes(f) for f in frames[2:]
        )
        response = v2.ModelInferResponse.FromString(body)
        if response.raw_output_contents:
            values = np.frombuffer(response.raw_output_contents[0], dtype=np.float32)
        else:
            values = np.asarray(response.outputs[0].contents.fp32_contents)
        out.append((True, None, values.reshape(tuple(response.outputs[0].shape)).tolist()))
    return out


def test_alike_calls_share_one_predict_and_get_their_own_rows(worker):
    replies = in_order(worker, calls(request([[1, 2]]), request([[3, 4], [5, 6]]), request([[7, 8]])))
    assert worker.models.by_id["m"].model.batches == [4]
    assert answers(replies) == [
        (True, None, [[2, 4]]),
        (True, None, [[6, 8], [10, 12]]),
        (True, None, [[14, 16]]),
    ]


def test_raw_and_typed_calls_each_get_their_own_form_back(worker):
    replies = in_order(worker, calls(request([[1, 2]], raw=True), request([[3, 4]])))
    assert worker.models.by_id["m"].model.batches == [2]
    assert [len(frames) for frames in replies] == [3, 2], "the raw call's output travels as its own frame"
    assert answers(replies) == [(True, None, [[2, 4]]), (True, None, [[6, 8]])]


def test_batches_hold_at_most_batch_max_calls(worker):
    worker.batch_max = 2
    replies = in_order(worker, calls(*[request([[i, i]]) for i in range(5)]))
    assert sorted(worker.models.by_id["m"].model.batches) == [1, 2, 2]
    assert [a[2] for a in answers(replies)] == [[[2 * i, 2 * i]] for i in range(5)]


def test_calls_that_differ_run_apart(worker):
    bodies = [
        request([[1, 2]]),
        request([[3, 4, 5]]),
        request([[6, 7]], datatype="FP64"),
        request([[8, 9]], outputs=["y"]),
        request([[1, 1]]),
    ]
    replies = in_order(worker, calls(*bodies))
    assert sorted(worker.models.by_id["m"].model.batches) == [1, 1, 1, 2], (
        "only the first and last call look alike"
    )
    assert all(ok for ok, _, _ in answers(replies[:2] + replies[3:]))


def test_a_bad_request_fails_alone(worker):
    replies = in_order(worker, calls(request([[1, 2]]), b"\xff\xff not protobuf", request([[3, 4]])))
    assert worker.models.by_id["m"].model.batches == [2]
    assert [(ok, kind) for ok, kind, _ in answers(replies)] == [
        (True, None),
        (False, protocol.ERROR_INVALID_INPUT),
        (True, None),
    ]


def test_an_expired_call_is_not_run(worker):
    expired = calls(request([[9, 9], [9, 9]]), deadline=time.time() - 1)
    fresh = calls(request([[1, 2]]), request([[3, 4]]))
    for index, (header, _) in enumerate(fresh):
        header["id"] = 200 + index
    replies = in_order(worker, expired + fresh)
    assert worker.models.by_id["m"].model.batches == [2], "the expired call's rows were predicted"
    assert [(ok, kind) for ok, kind, _ in answers(replies)] == [
        (False, protocol.ERROR_EXPIRED),
        (True, None),
        (True, None),
    ]


def test_a_failing_batch_is_retried_call_by_call(worker):
    replies = in_order(worker, calls(request([[1, 2]]), request([[666, 0]]), request([[3, 4]])))
    assert worker.models.by_id["m"].model.batches == [3, 1, 1, 1]
    assert [(ok, kind) for ok, kind, _ in answers(replies)] == [
        (True, None),
        (False, protocol.ERROR_MODEL),
        (True, None),
    ]


def test_outputs_that_are_not_per_row_are_retried_call_by_call(worker):
    hold(worker, RowModel(per_row=False), "sklearn", batches_rows=True)
    replies = in_order(worker, calls(request([[1, 2]]), request([[3, 4]])))
    assert worker.models.by_id["m"].model.batches == [2, 1, 1]
    assert [values for _, _, values in answers(replies)] == [[3.0], [7.0]]


class PerOutputModel(RowModel):
    """Answers as scikit-learn's multi-output classifiers answer predict_proba: a list holding one
    [rows, ...] array per output, not an array of rows."""

    def predict(self, inputs, parameters, requested_outputs):
        x = inputs["x"]
        self.batches.append(x.shape[0])
        return {"y": [x * 2, x * 3]}


def test_outputs_that_are_lists_are_retried_call_by_call(worker):
    # Two calls of one row: the list's length equals the rows in all, so splitting it would hand
    # each call one output of both calls' rows.
    hold(worker, PerOutputModel(), "sklearn", batches_rows=True)
    replies = in_order(worker, calls(request([[1, 2]]), request([[3, 4]])))
    assert worker.models.by_id["m"].model.batches == [2, 1, 1]
    first, second = [values for _, _, values in answers(replies)]
    assert first == [[[2.0, 4.0]], [[3.0, 6.0]]] and second == [[[6.0, 8.0]], [[9.0, 12.0]]]


def test_models_that_are_not_row_wise_never_share(worker):
    hold(worker, worker.models.by_id["m"].model, "sklearn", batches_rows=False)
    in_order(worker, calls(request([[1, 2]]), request([[3, 4]])))
    assert worker.models.by_id["m"].model.batches == [1, 1]


def row_wise(model_id):
    return model_id == "m"


@pytest.mark.parametrize(
    "held, last_batch, unanswered, batch_max, waits",
    [
        (1, 2, 3, 4, True),  # calls came together last time, two more unanswered at the front
        (2, 1, 4, 4, True),  # calls came together now
        (1, 1, 8, 4, False),  # a call alone after a call alone
        (1, 2, 2, 4, False),  # one more at the front: two clients taking turns
        (2, 2, 3, 4, False),  # the same with both calls in hand
        (4, 4, 16, 4, False),  # the batch is full
    ],
)
def test_a_worker_waits_for_another_call_only_when_more_are_coming(
    held, last_batch, unanswered, batch_max, waits
):
    header = protocol.header(
        protocol.OP_CALL, 1, model="m", method=protocol.METHOD_INFER, unanswered=unanswered
    )
    assert batching.worth_waiting(held, last_batch, batch_max, header, row_wise) is waits


@pytest.mark.parametrize(
    "header",
    [
        protocol.header(protocol.OP_CALL, 1, model="m"),
        protocol.header(protocol.OP_CALL, 1, model="m", unanswered=None),
        protocol.header(protocol.OP_CALL, 1, model="m", unanswered="8"),
        protocol.header(protocol.OP_CALL, 1, model="other", unanswered=8),
        b"not msgpack",
    ],
    ids=["no count", "a count of None", "a count that is text", "a model that does not batch", "not ours"],
)
def test_only_a_well_formed_call_for_a_row_wise_model_makes_a_worker_wait(header):
    assert not batching.worth_waiting(2, 2, 4, header, row_wise)


def test_front_gives_batching_workers_room_for_a_batch():
    assert slots_per_worker(threads=1, batch_max=8, batches_rows=True) == 9
    assert slots_per_worker(threads=1, batch_max=1, batches_rows=True) == 1 + PIPELINE_DEPTH
    assert slots_per_worker(threads=1, batch_max=8, batches_rows=False) == 1 + PIPELINE_DEPTH
    assert slots_per_worker(threads=4, batch_max=8, batches_rows=True) == 4 + PIPELINE_DEPTH


@pytest.mark.slow  # its fork server imports sklearn
def test_sklearn_calls_under_load_each_get_their_own_prediction(tmp_path):
    """64 concurrent calls of different rows against a real iris LogisticRegression."""
    pytest.importorskip("sklearn")
    import joblib
    from harness import Runtime, mesh_headers
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    features, labels = load_iris(return_X_y=True)
    estimator = LogisticRegression(max_iter=1000).fit(features, labels)
    rows = features[::2][:64].astype(np.float32)
    expected = estimator.predict(rows)
    # sklearn's fork server, as in production; the other frameworks' would only cost the start.
    with Runtime(WORKERS_WARM="1", WORKER_PRELOAD="numpy,sklearn") as rt:
        path = f"{rt.models}/iris-batch"
        os.makedirs(path)
        joblib.dump(estimator, f"{path}/model.joblib")
        rt.load("iris-batch", path, fmt="sklearn")

        def predict(row):
            message = v2.ModelInferRequest(model_name="iris-batch")
            message.inputs.add(name="x", datatype="FP32", shape=[1, 4]).contents.fp32_contents.extend(row)
            response = rt.infer.ModelInfer(message, metadata=mesh_headers("iris-batch"), timeout=30)
            return response.outputs[0].contents.int64_contents[0]

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(predict, rows))
        assert got == expected.tolist()
        log = rt.log()
    assert "ERROR" not in log and "batch of" not in log, "a batch failed or the runtime logged an error"


def test_calls_for_two_models_of_a_pack_never_share_a_predict(worker):
    first, second = RowModel(), RowModel()
    worker.models.by_id = {
        "a": Held("a", "sklearn", first, True),
        "b": Held("b", "sklearn", second, True),
    }
    queued = calls(request([[1, 2]]), request([[3, 4]]), request([[5, 6]]), request([[7, 8]]))
    for (header, _), model_id in zip(queued, ("a", "b", "a", "b"), strict=True):
        header["model"] = model_id
    replies = in_order(worker, queued)
    assert (first.batches, second.batches) == ([2], [2]), "each model predicts its own two calls at once"
    assert [values for _, _, values in answers(replies)] == [
        [[2.0, 4.0]],
        [[6.0, 8.0]],
        [[10.0, 12.0]],
        [[14.0, 16.0]],
    ]


class HugeErrorModel(RowModel):
    def predict(self, inputs, parameters, requested_outputs):
        raise ValueError("row " * 1_000_000)


def test_a_failed_batch_logs_its_error_cut_as_a_reply_s(worker, caplog):
    hold(worker, HugeErrorModel(), "sklearn", batches_rows=True)
    with caplog.at_level("INFO", logger="mesh.worker"):
        in_order(worker, calls(request([[1, 2]]), request([[3, 4]])))
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("a batch of")]
    assert said and len(said[0]) < protocol.ERROR_MESSAGE_MAX_CHARS + 200
