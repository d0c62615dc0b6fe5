"""scikit-learn models: an estimator or pipeline saved with joblib or pickle.

modelPath is the .joblib / .pkl / .pickle file or the folder holding it. The
first input tensor goes to the estimator as it is; outputs are named as
MLServer names them: `predict`, and `predict_proba` only when the request
asks for it (it costs a second pass) and the estimator has it.
"""

from __future__ import annotations

import numpy as np

from workers.formats import common

PREDICT = "predict"
PREDICT_PROBA = "predict_proba"
INPUT_NAME = "input-0"  # what metadata() advertises; any name is accepted


def load(path: str) -> SklearnModel:
    import joblib  # scikit-learn's own dependency; it reads plain pickles too

    estimator = joblib.load(common.model_file(path, "sklearn"))
    if not callable(getattr(estimator, "predict", None)):
        raise TypeError(f"the file holds a {type(estimator).__name__}, which has no predict()")
    return SklearnModel(estimator)


class SklearnModel:
    handles_methods = False

    def __init__(self, estimator):
        self.estimator = estimator
        # Pipelines that start with a text vectoriser have no n_features_in_ and take 1-D text.
        self.n_features = getattr(estimator, "n_features_in_", None)
        # hasattr, not callable(getattr()): SVC(probability=False) raises AttributeError here.
        self.has_proba = hasattr(estimator, PREDICT_PROBA)

    def predict(self, inputs: dict, parameters: dict, requested_outputs: list[str]) -> dict:
        features = self._features(common.first_input(inputs))
        outputs = {}
        if not requested_outputs or PREDICT in requested_outputs:
            outputs[PREDICT] = self.estimator.predict(features)
        if PREDICT_PROBA in requested_outputs and self.has_proba:
            outputs[PREDICT_PROBA] = self.estimator.predict_proba(features)
        # A requested output we do not produce is reported by v2.encode_response.
        return outputs

    def _features(self, array: np.ndarray) -> np.ndarray:
        if array.dtype == object:
            return common.as_text(array)  # for text pipelines
        if self.n_features is None:
            return array
        return common.feature_rows(array, self.n_features)

    def metadata(self) -> dict:
        # Without n_features_in_ (a text pipeline, say) the input is not known.
        described = (
            common.tensor(INPUT_NAME, "FP64", [-1, self.n_features])
            if self.n_features
            else common.tensor(INPUT_NAME, "", [-1])
        )
        classes = getattr(self.estimator, "classes_", None)
        label = common.datatype_of(classes.dtype) if isinstance(classes, np.ndarray) else "FP64"
        outputs = [common.tensor(PREDICT, label, [-1])]
        if self.has_proba and isinstance(classes, np.ndarray):
            outputs.append(common.tensor(PREDICT_PROBA, "FP64", [-1, len(classes)]))
        return {"platform": "sklearn", "inputs": [described], "outputs": outputs}

    def close(self) -> None:
        pass
