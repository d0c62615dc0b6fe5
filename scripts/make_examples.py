#!/usr/bin/env python3
"""Writes the example models into a folder, one sub-folder per model.

Every example is the same small classifier of the iris flowers (scikit-learn
ships the data set), so one sample input gets the same answer from each:

    iris-sklearn/model.joblib   LogisticRegression, saved with joblib
    iris-xgboost/model.json     boosted trees (multi:softprob)
    iris-lightgbm/model.txt     boosted trees (multiclass)
    iris-onnx/model.onnx        the logistic regression as an ONNX graph (onnx helper API)
    iris-pytorch/model.pt       the logistic regression as a TorchScript module
    iris-python/model.py        the logistic regression in numpy (examples/iris-python)

An example whose framework is not installed is skipped, with the reason.
Nothing is downloaded and nothing random is left unseeded: the same versions
write the same models. examples/README.md lists the expected answers.

usage: scripts/make-examples FOLDER
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import sys
import warnings
from collections.abc import Callable

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A setosa and a virginica from the data set: classes 0 and 2.
SAMPLE = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], dtype=np.float32)
INPUT_NAME = "features"  # the onnx graph and the custom model read this name; the others take any


@dataclasses.dataclass(frozen=True)
class Example:
    name: str  # folder name and model id
    format: str  # mesh-runtime format name
    needs: tuple[str, ...]  # modules that must be importable to write and serve it
    extra: str  # pip extra that installs them
    build: Callable[[str, Iris], None]
    outputs: tuple[str, ...] = ()  # outputs to ask for (empty: the model's default)

    def missing(self) -> list[str]:
        return [m for m in self.needs if importlib.util.find_spec(m) is None]


@dataclasses.dataclass(frozen=True)
class Iris:
    features: np.ndarray  # float64 [150, 4]
    labels: np.ndarray  # int64 [150]
    coef: np.ndarray  # the fitted logistic regression, float64 [3, 4]
    intercept: np.ndarray  # float64 [3]
    estimator: object


def iris() -> Iris:
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    features, labels = load_iris(return_X_y=True)
    estimator = LogisticRegression(max_iter=1000).fit(features, labels)
    return Iris(features, labels, estimator.coef_, estimator.intercept_, estimator)


# -- one writer per format -----------------------------------------------------------------


def write_sklearn(folder: str, data: Iris) -> None:
    import joblib

    joblib.dump(data.estimator, os.path.join(folder, "model.joblib"))


def write_xgboost(folder: str, data: Iris) -> None:
    import xgboost

    params = {
        "objective": "multi:softprob",
        "num_class": 3,
        "max_depth": 2,
        "eta": 0.3,
        "nthread": 1,
        "seed": 0,
    }
    booster = xgboost.train(params, xgboost.DMatrix(data.features, label=data.labels), num_boost_round=20)
    booster.save_model(os.path.join(folder, "model.json"))


def write_lightgbm(folder: str, data: Iris) -> None:
    import lightgbm

    params = {
        "objective": "multiclass",
        "num_class": 3,
        "num_leaves": 4,
        "min_data_in_leaf": 5,
        "num_threads": 1,
        "deterministic": True,
        "seed": 0,
        "verbose": -1,
    }
    booster = lightgbm.train(params, lightgbm.Dataset(data.features, label=data.labels), num_boost_round=20)
    booster.save_model(os.path.join(folder, "model.txt"))


def write_onnx(folder: str, data: Iris) -> None:
    """The logistic regression as a graph: softmax(features @ W + b), and its argmax."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = numpy_helper.from_array(data.coef.T.astype(np.float32), "W")
    bias = numpy_helper.from_array(data.intercept.astype(np.float32), "b")
    nodes = [
        helper.make_node("MatMul", [INPUT_NAME, "W"], ["scores"]),
        helper.make_node("Add", ["scores", "b"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes,
        "iris",
        [helper.make_tensor_value_info(INPUT_NAME, TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
            helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["batch", 3]),
        ],
        initializer=[weights, bias],
    )
    # Opset 13 and IR 8: what onnxruntime releases of the last years all read.
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 13)],
        ir_version=8,
        producer_name="mesh-runtime make-examples",
    )
    onnx.checker.check_model(model)
    onnx.save(model, os.path.join(folder, "model.onnx"))


def write_pytorch(folder: str, data: Iris) -> None:
    """The logistic regression as a TorchScript module returning class probabilities."""
    import torch

    class IrisNet(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def forward(self, features: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.linear(features), dim=1)

    net = IrisNet()
    with torch.no_grad():
        net.linear.weight.copy_(torch.from_numpy(data.coef))
        net.linear.bias.copy_(torch.from_numpy(data.intercept))
    with warnings.catch_warnings():
        # torch 2.13 deprecates TorchScript in favour of torch.export; TorchScript
        # is still what Triton, TorchServe and this runtime's pytorch format load.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(net.eval()), os.path.join(folder, "model.pt"))


def write_python(folder: str, data: Iris) -> None:
    shutil.copy(os.path.join(REPO, "examples", "iris-python", "model.py"), folder)
    np.savez(os.path.join(folder, "weights.npz"), coef=data.coef, intercept=data.intercept)


EXAMPLES: tuple[Example, ...] = (
    Example(
        "iris-sklearn",
        "sklearn",
        ("sklearn",),
        "sklearn",
        write_sklearn,
        outputs=("predict", "predict_proba"),
    ),
    Example("iris-xgboost", "xgboost", ("sklearn", "xgboost"), "xgboost", write_xgboost),
    Example("iris-lightgbm", "lightgbm", ("sklearn", "lightgbm"), "lightgbm", write_lightgbm),
    Example("iris-onnx", "onnx", ("sklearn", "onnx", "onnxruntime"), "onnx", write_onnx),
    Example("iris-pytorch", "pytorch", ("sklearn", "torch"), "pytorch", write_pytorch),
    Example("iris-python", "python", ("sklearn",), "sklearn", write_python),
)


def make(folder: str, log: Callable[[str], None] = print) -> list[Example]:
    """Writes every example whose modules are installed into folder; returns those written."""
    written = []
    data = iris() if importlib.util.find_spec("sklearn") else None
    for example in EXAMPLES:
        missing = example.missing()
        if missing:
            log(
                f"skipped {example.name}: {', '.join(missing)} not installed "
                f"(pip install 'mesh-runtime[{example.extra}]')"
            )
            continue
        target = os.path.join(folder, example.name)
        os.makedirs(target, exist_ok=True)
        example.build(target, data)
        written.append(example)
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    for example in make(argv[0]):
        print(f"wrote {os.path.join(argv[0], example.name)} ({example.format})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
