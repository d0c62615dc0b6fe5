"""XGBoost models: a Booster saved as JSON (.json) or UBJSON (.ubj).

modelPath is the file or the folder holding it. The first input tensor is a
batch of feature rows; the output `predict` is what Booster.predict gives
(labels, scores or, for multi:softprob, one probability per class).
"""

from __future__ import annotations

import numpy as np

from workers.formats import common, warming

PREDICT = "predict"
INPUT_NAME = "input-0"  # what metadata() advertises; any name is accepted


def load(path: str) -> XGBoostModel:
    import xgboost

    booster = xgboost.Booster()
    booster.load_model(common.model_file(path, "xgboost"))
    return XGBoostModel(booster)


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
        # One row of zeros tells the output's type and shape, which the
        # objective decides; it also warms the predictor up before the first call.
        self.sample = self._predict(np.zeros((1, self.n_features), dtype=np.float32))

    def _predict(self, rows: np.ndarray) -> np.ndarray:
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
