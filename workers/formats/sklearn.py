"""scikit-learn models: an estimator or pipeline saved with joblib or pickle.

modelPath is the .joblib / .pkl / .pickle file or the folder holding it. The
first input tensor goes to the estimator as it is; outputs are named as
MLServer names them: `predict`, and `predict_proba` only when the request
asks for it (it costs a second pass) and the estimator has it.
"""

from __future__ import annotations

import importlib
import io
import pickle
import struct
import warnings

import numpy as np

from workers import v2
from workers.formats import common

PREDICT = "predict"
PREDICT_PROBA = "predict_proba"
INPUT_NAME = "input-0"  # what metadata() advertises; any name is accepted

# The estimator families most saved models are made of. An unpickle imports
# the modules of its estimator's family (sklearn.linear_model alone is about
# a hundred modules): imported by the fork server, they are shared by every
# worker instead of each worker importing its own private copy.
ESTIMATOR_MODULES = (
    "sklearn.linear_model",
    "sklearn.svm",
    "sklearn.tree",
    "sklearn.ensemble",
    "sklearn.neighbors",
    "sklearn.naive_bayes",
    "sklearn.neural_network",
    "sklearn.cluster",
    "sklearn.decomposition",
    "sklearn.pipeline",
    "sklearn.compose",
    "sklearn.preprocessing",
    "sklearn.impute",
    "sklearn.feature_extraction.text",
)


def load(path: str) -> SklearnModel:
    import joblib  # scikit-learn's own dependency; it reads plain pickles too

    file = common.model_file(path, "sklearn")
    try:
        estimator = joblib.load(file)
    except EOFError:  # raised without a message, which would leave the load's status saying nothing
        raise EOFError(f"{file} ends before its pickle does: empty or cut short") from None
    except (pickle.UnpicklingError, KeyError, IndexError, ValueError, struct.error) as error:
        # What bytes that are no pickle raise ("KeyError: 110"); a pickle of another library
        # version raises some of them too, so the message stays, with the question to ask.
        raise ValueError(
            f"cannot unpickle {file} ({type(error).__name__}: {error}): "
            "is it a scikit-learn model saved with joblib or pickle?"
        ) from error  # the logged traceback then shows where the unpickling failed
    if not callable(getattr(estimator, "predict", None)):
        raise TypeError(f"the file holds a {type(estimator).__name__}, which has no predict()")
    model = SklearnModel(estimator)
    model.rehearse()
    return model


def warm() -> None:
    """Fork server: imports the estimator modules, then unpickles and predicts once.

    The first predict of a process fills scikit-learn's caches (its config,
    the dataframe libraries it checks inputs against); none starts a thread.
    """
    import joblib

    for name in ESTIMATOR_MODULES:
        importlib.import_module(name)
    saved = io.BytesIO()
    joblib.dump(_tiny_classifier(), saved)
    saved.seek(0)
    model = SklearnModel(joblib.load(saved))
    model.predict({"x": np.zeros((2, 2), dtype=np.float32)}, {}, [PREDICT, PREDICT_PROBA])


def _tiny_classifier():
    """A logistic regression of 2 features and 2 classes, set by hand: fitting would cost far more."""
    from sklearn.linear_model import LogisticRegression

    estimator = LogisticRegression()
    estimator.coef_ = np.zeros((1, 2))
    estimator.intercept_ = np.zeros(1)
    estimator.classes_ = np.arange(2)
    estimator.n_features_in_ = 2
    return estimator


class SklearnModel:
    handles_methods = False

    def __init__(self, estimator):
        self.estimator = estimator
        # Pipelines that start with a text vectoriser have no n_features_in_ and take 1-D text.
        self.n_features = getattr(estimator, "n_features_in_", None)
        # hasattr, not callable(getattr()): SVC(probability=False) raises AttributeError here.
        self.has_proba = hasattr(estimator, PREDICT_PROBA)
        self.outputs = [PREDICT, PREDICT_PROBA] if self.has_proba else [PREDICT]

    def rehearse(self) -> None:
        """Predicts a row of zeros once, so that the first call does not pay for first touches.

        A worker's first pass through scikit-learn's validation code copies the
        fork server's pages it writes to (reference counts): hundreds of page
        faults, which this moves from the first call into the load.
        """
        if not self.n_features:
            return  # a text pipeline: no row to make up
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.estimator.predict(np.zeros((1, self.n_features)))
        except Exception:
            pass  # a model that refuses zeros is served all the same; its first call pays

    def predict(self, inputs: dict, parameters: dict, requested_outputs: list[str]) -> dict:
        common.check_requested(requested_outputs, self.outputs)
        features = self._features(common.first_input(inputs))
        outputs = {}
        if not requested_outputs or PREDICT in requested_outputs:
            outputs[PREDICT] = _answer(self.estimator.predict, features)
        if PREDICT_PROBA in requested_outputs and self.has_proba:
            outputs[PREDICT_PROBA] = _answer(self.estimator.predict_proba, features)
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


def _answer(method, features: np.ndarray) -> np.ndarray:
    """method(features). scikit-learn refuses no rows, which the other formats answer with no rows:
    those are one made-up row's answer cut to none, of the dtype and columns real rows get."""
    if features.ndim == 0 or len(features):
        return method(features)
    fill = "" if features.dtype == object else 0  # a text pipeline reads an empty text
    try:
        return method(np.full((1, *features.shape[1:]), fill, dtype=features.dtype))[:0]
    except Exception:
        raise v2.InvalidInput("the input has no rows, and this model answers none") from None
