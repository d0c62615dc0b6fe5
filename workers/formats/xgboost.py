"""XGBoost models: a Booster saved as JSON (.json) or UBJSON (.ubj).

modelPath is the file or the folder holding it. The first input tensor is a
batch of feature rows; the output `predict` is what Booster.predict gives
(labels, scores or, for multi:softprob, one probability per class).
"""

from __future__ import annotations

import ctypes
import json

import numpy as np

from workers.formats import common, warming

PREDICT = "predict"
INPUT_NAME = "input-0"  # what metadata() advertises; any name is accepted


def load(path: str) -> XGBoostModel:
    import xgboost

    booster = xgboost.Booster()
    file = common.model_file(path, "xgboost")
    try:
        booster.load_model(file)
    except (xgboost.core.XGBoostError, UnicodeDecodeError) as error:
        raise xgboost.core.XGBoostError(f"cannot read {file}: {_last_error(xgboost.core, error)}") from None
    return XGBoostModel(booster)


def _last_error(core, error: Exception) -> str:
    """The library's message for the call that failed, without its native backtrace (addresses in
    libxgboost.so, of no use to the model's owner, filling most of the load's status message).
    Read as bytes: where it quotes the byte a file ended at (EOF as 0xff), the wrapper's own
    decoding raises UnicodeDecodeError, which would blame the file's encoding instead. The C
    function is not xgboost's Python API: where it is not there, the error as raised."""
    try:
        message = core._LIB.XGBGetLastError().decode(errors="replace")
    except Exception:
        message = str(error)
    return message.split("\nStack trace:", 1)[0]


def warm() -> None:
    """Fork server: creates a Booster, saves it as JSON and loads it back, if OpenMP runs no thread.

    Saving and loading run OpenMP loops, which start OpenMP's pool when it
    may run more than one thread. No predict either way: the worker's load()
    makes the first one.
    """
    if not warming.openmp_is_single_threaded():
        return
    import xgboost

    saved = xgboost.Booster({"num_feature": 1}).save_raw("json")
    xgboost.Booster().load_model(saved)


class XGBoostModel:
    handles_methods = False

    def __init__(self, booster):
        self.booster = booster
        self.n_features = booster.num_features()
        self.dense = DensePredictor.for_booster(booster, self.n_features)
        # One row of zeros tells the output's type and shape, which the
        # objective decides; it also warms the predictor up before the first call.
        self.sample = self._predict(np.zeros((1, self.n_features), dtype=np.float32))

    def _predict(self, rows: np.ndarray) -> np.ndarray:
        if not len(rows) and hasattr(self, "sample"):
            # The C function fails on no data, and inplace_predict answers a multi-class model's
            # no rows as (0,), not as (0, classes) as it answers rows and metadata() says.
            return np.empty((0, *self.sample.shape[1:]), dtype=self.sample.dtype)
        if self.dense is not None and rows.dtype in DensePredictor.DTYPES:
            return self.dense.predict(rows)
        # inplace_predict skips building a DMatrix and is safe from several threads.
        return self.booster.inplace_predict(rows)

    def predict(self, inputs: dict, parameters: dict, requested_outputs: list[str]) -> dict:
        rows = common.feature_rows(common.first_input(inputs), self.n_features)
        return {PREDICT: self._predict(rows)}

    def metadata(self) -> dict:
        return {
            "platform": "xgboost",
            "inputs": [common.tensor(INPUT_NAME, "FP32", [-1, self.n_features])],
            "outputs": [
                common.tensor(PREDICT, common.datatype_of(self.sample.dtype), [-1, *self.sample.shape[1:]])
            ],
        }

    def close(self) -> None:
        pass


class DensePredictor:
    """What Booster.inplace_predict does for a float array, without what it rebuilds per call.

    For each call the wrapper encodes the same prediction config as JSON, inspects the input
    against a dozen data types, and builds a class to wrap the output: for a tiny model three
    times the C library's own time, and garbage whose pages a pack keeps (docs/density.md). This
    encodes the config once and calls the same C function, XGBoosterPredictFromDense. It is used
    only where it agrees with inplace_predict on a row of zeros at load (for_booster); otherwise,
    and for other dtypes, inplace_predict serves.
    """

    DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
    _CONFIG = json.dumps(
        {
            "type": 0,  # predicted values, not margins
            "training": False,
            "iteration_begin": 0,
            "iteration_end": 0,  # every tree
            "missing": float("nan"),
            "strict_shape": False,
            "cache_id": 0,
        }
    ).encode()

    def __init__(self, booster, library, check_call, size_type):
        self.booster = booster
        self._library, self._check_call, self._size_type = library, check_call, size_type

    @classmethod
    def for_booster(cls, booster, n_features: int) -> DensePredictor | None:
        try:
            from xgboost import core

            predictor = cls(booster, core._LIB, core._check_call, core.c_bst_ulong)
            zeros = np.zeros((1, n_features), dtype=np.float32)
            expected = booster.inplace_predict(zeros)
            got = predictor.predict(zeros)
        except Exception:  # another xgboost than the one this was written against
            return None
        if got.dtype != expected.dtype or not np.array_equal(got, expected, equal_nan=True):
            return None
        return predictor

    def predict(self, rows: np.ndarray) -> np.ndarray:
        rows = np.ascontiguousarray(rows)
        interface = b'{"data": [%d, true], "shape": [%d, %d], "typestr": "%s", "version": 3}' % (
            rows.ctypes.data,
            rows.shape[0],
            rows.shape[1],
            rows.dtype.str.encode(),
        )
        shape = ctypes.POINTER(self._size_type)()
        dims = self._size_type()
        values = ctypes.POINTER(ctypes.c_float)()
        self._check_call(
            self._library.XGBoosterPredictFromDense(
                self.booster.handle,
                interface,
                self._CONFIG,
                None,  # no proxy matrix: no base margin
                ctypes.byref(shape),
                ctypes.byref(dims),
                ctypes.byref(values),
            )
        )
        # The values live in the booster's buffer for this thread until its next prediction: copied.
        return np.ctypeslib.as_array(values, shape=tuple(shape[i] for i in range(dims.value))).copy()
