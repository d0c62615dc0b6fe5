"""A custom model for mesh-runtime: iris logistic regression in plain numpy.

scripts/make-examples writes weights.npz beside this file (the coefficients
of the scikit-learn example), so all the iris examples answer alike.
"""

import os

import numpy as np


class Model:
    def __init__(self, path):  # path: the model's folder; load everything here
        weights = np.load(os.path.join(path, "weights.npz"))
        self.coef, self.intercept = weights["coef"], weights["intercept"]

    def predict(self, inputs):  # inputs: {name: numpy array}
        scores = inputs["features"].astype(np.float64) @ self.coef.T + self.intercept
        scores = np.exp(scores - scores.max(axis=1, keepdims=True))
        proba = scores / scores.sum(axis=1, keepdims=True)
        return {"predict": proba.argmax(axis=1), "predict_proba": proba}

    def metadata(self):
        classes = len(self.intercept)
        return {
            "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 4]}],
            "outputs": [
                {"name": "predict", "datatype": "INT64", "shape": [-1]},
                {"name": "predict_proba", "datatype": "FP64", "shape": [-1, classes]},
            ],
        }
