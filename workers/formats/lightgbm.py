"""LightGBM models: a Booster saved as text (.txt, Booster.save_model).

modelPath is the file or the folder holding it. The first input tensor is a
batch of feature rows; the output `predict` is what Booster.predict gives
(scores, or one probability per class for multiclass objectives).
"""

from __future__ import annotations

import numpy as np

from workers.formats import common

PREDICT = "predict"
INPUT_NAME = "input-0"  # what metadata() advertises; any name is accepted


def load(path: str) -> LightGBMModel:
    import lightgbm

    # LightGBM parses a model held in memory several times faster than it reads the same file.
    file = common.model_file(path, "lightgbm")
    with open(file, encoding="utf-8") as model:
        text = model.read()
    # It parses the trees in an OpenMP loop, where its error for a tree cut short cannot propagate:
    # the process aborts, a pack with every model it holds. Every model it saves ends its trees so.
    if "end of trees" not in text:
        raise ValueError(
            f"{file} is not a whole LightGBM model, or was cut short: it has no 'end of trees' line"
        )
    return LightGBMModel(lightgbm.Booster(model_str=text))


class LightGBMModel:
    handles_methods = False

    def __init__(self, booster):
        self.booster = booster
        self.n_features = booster.num_feature()
        # One row of zeros tells the output's type and shape, which the
        # objective decides; it also warms the predictor up before the first call.
        self.sample = booster.predict(np.zeros((1, self.n_features)))

    def predict(self, inputs: dict, parameters: dict, requested_outputs: list[str]) -> dict:
        rows = common.feature_rows(common.first_input(inputs), self.n_features)
        if not len(rows):
            # Booster.predict answers a multiclass model's no rows as (0,), not as (0, classes)
            # as it answers rows and metadata() says.
            return {PREDICT: np.empty((0, *self.sample.shape[1:]), dtype=self.sample.dtype)}
        return {PREDICT: self.booster.predict(rows)}

    def metadata(self) -> dict:
        return {
            "platform": "lightgbm",
            "inputs": [common.tensor(INPUT_NAME, "FP64", [-1, self.n_features])],
            "outputs": [
                common.tensor(PREDICT, common.datatype_of(self.sample.dtype), [-1, *self.sample.shape[1:]])
            ],
        }

    def close(self) -> None:
        pass
