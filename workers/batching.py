"""Calls that queued up while a row-wise model was busy share one predict.

sklearn, xgboost and lightgbm models answer each row of their input on its
own, and most of what one predict costs does not depend on the rows:
scikit-learn's input checks take ~240 us for one iris row and about as long
for eight. So when several ModelInfer calls already wait in the worker's
socket (the front lets such a worker hold WORKER_BATCH_MAX of them), the
worker stacks their rows, predicts once and hands each call its own rows
back. A call that arrives alone runs alone, at once, unless the calls
before it came queued together: then more are likely on their way, and the
worker waits up to WORKER_BATCH_WAIT_US for one (workers/loop.py).

Calls share a predict only when they look alike: the same input names,
datatypes and row shapes, the same requested outputs and parameters. The
worker runs a call on its own when it does not fit, and runs every call of
a batch on its own when the shared predict raises or returns something that
is not one row per input row, so a bad call fails only itself.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from protos import grpc_predict_v2_pb2 as pb


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

    Raises ValueError when an output is not one row per input row (such a
    model cannot share predicts; the caller runs the calls one by one).
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
    arrays = {name: np.asarray(value) for name, value in outputs.items()}
    for name, array in arrays.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise ValueError(f"output {name!r} has shape {array.shape}, not one row per input row ({total})")
    shares, start = [], 0
    for count in rows:
        shares.append({name: array[start : start + count] for name, array in arrays.items()})
        start += count
    return shares
