"""Calls that queued up while a row-wise model was busy share one predict.

sklearn, xgboost and lightgbm models answer each row of their input on its
own, and most of what one predict costs does not depend on the rows:
scikit-learn's input checks take ~240 us for one iris row and about as long
for eight. So when several ModelInfer calls already wait in the worker's
socket (the front lets such a worker hold WORKER_BATCH_MAX of them), the
worker stacks their rows, predicts once and hands each call its own rows
back. When calls come together but nothing more is queued, and the front
says it is busy with more of the model's calls, the worker waits
WORKER_BATCH_WAIT_US once for one more (`worth_waiting`, workers/loop.py).

Calls share a predict only when they look alike: the same input names,
datatypes and row shapes, the same requested outputs and parameters. The
worker runs a call on its own when it does not fit, and runs every call of
a batch on its own when the shared predict raises or returns something that
is not one row per input row, so a bad call fails only itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from protos import grpc_predict_v2_pb2 as pb
from workers import protocol

# A worker waits for one more call only while the front counts at least this many
# more of the model's calls unanswered than the worker holds. With one more (two
# clients taking turns), the wait would hold a call back for about the other's
# whole trip through the front, which costs more than a shared predict saves.
UNANSWERED_BEYOND_HELD = 2


def worth_waiting(
    held: int, last_batch: int, batch_max: int, latest_header: bytes, row_wise: Callable[[Any], bool]
) -> bool:
    """Whether a worker holding `held` calls, none more queued, should wait for another.

    Calls came together (at this wake-up or the last), the batch has room,
    the latest call is for a model that batches rows (`row_wise(model)`),
    and its header says the front had enough more of that model's calls
    unanswered (per replica) than are in hand: the front is busy with the
    others' answers, and their clients send the next calls right after. One
    more call on a shared predict costs far less than its own.
    """
    if held >= batch_max or max(held, last_batch) < 2:
        return False
    try:
        header = protocol.parse_header(latest_header)
    except protocol.ProtocolError:
        return False  # the loop drops the message and says why
    unanswered = header.get("unanswered")
    if not isinstance(unanswered, int) or not row_wise(header.get("model")):
        return False
    return unanswered - held >= UNANSWERED_BEYOND_HELD


class InferCall(NamedTuple):
    """A decoded ModelInfer call, ready to predict."""

    request_id: int
    request: pb.ModelInferRequest
    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any]
    raw: bool
    requested: list[str]  # the request's output names, in its order (empty: all the model's)
    held: Any = None  # the worker's model it is for (workers/holding.py); None only in a rehearsal

    @property
    def rows(self) -> int | None:
        """Rows shared by every input; None when they differ or there are none."""
        counts = {array.shape[0] if array.ndim else None for array in self.inputs.values()}
        if len(counts) != 1:
            return None
        (count,) = counts
        return count or None


def _likeness(call: InferCall) -> tuple:
    """Calls with equal likeness may share one predict."""
    inputs = tuple((name, array.dtype, array.shape[1:]) for name, array in call.inputs.items())
    parameters = repr(sorted(call.parameters.items())) if call.parameters else ""
    return id(call.held), inputs, tuple(call.requested), parameters


def groups(calls: list[InferCall], batch_max: int) -> list[list[InferCall]]:
    """The calls split into groups that may share a predict, each at most batch_max long."""
    by_likeness: dict[tuple, list[list[InferCall]]] = {}
    alone = []
    for call in calls:
        if call.rows is None:
            alone.append([call])
            continue
        runs = by_likeness.setdefault(_likeness(call), [[]])
        if len(runs[-1]) == batch_max:
            runs.append([])
        runs[-1].append(call)
    return alone + [group for runs in by_likeness.values() for group in runs]


def stacked_inputs(group: list[InferCall]) -> dict[str, np.ndarray]:
    """Every input of the group's calls, their rows one after the other."""
    return {name: np.concatenate([call.inputs[name] for call in group]) for name in group[0].inputs}


def split_outputs(group: list[InferCall], outputs: Any) -> list[dict[str, np.ndarray]]:
    """Each call's rows of a shared predict's outputs.

    Raises ValueError when an output is not an array of one row per input
    row (such a model cannot share predicts; the caller runs the calls one
    by one). An output given as a list is refused whatever its length:
    scikit-learn's multi-output classifiers answer predict_proba with a list
    of one [rows, classes] array per output, whose first axis is not rows.
    """
    if not isinstance(outputs, dict):
        raise ValueError(f"predict() returned {type(outputs).__name__}, not a dict")
    rows: list[int] = []
    for call in group:
        count = call.rows
        if count is None:  # groups() keeps such a call alone
            raise ValueError("a call's inputs do not share a row count")
        rows.append(count)
    total = sum(rows)
    for name, array in outputs.items():
        if not isinstance(array, np.ndarray):
            raise ValueError(f"output {name!r} is a {type(array).__name__}, not an array of rows")
        if array.ndim == 0 or array.shape[0] != total:
            raise ValueError(f"output {name!r} has shape {array.shape}, not one row per input row ({total})")
    arrays: dict[str, np.ndarray] = outputs
    shares, start = [], 0
    for count in rows:
        shares.append({name: array[start : start + count] for name, array in arrays.items()})
        start += count
    return shares
