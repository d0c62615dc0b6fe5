"""Custom Python models: a model.py that defines `class Model`.

The worker calls `Model(path)` (path = the modelPath it was given; the
constructor loads), then `predict(inputs)` or `predict(inputs, parameters)`
with `inputs: dict[str, numpy.ndarray]`, expecting `dict[str, numpy.ndarray]`
back. Optional methods: `metadata()`, `handle(method, request_bytes)`, `close()`.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from typing import Any


def load(path: str) -> PythonModel:
    source = os.path.join(path, "model.py") if os.path.isdir(path) else path
    folder = os.path.dirname(source)
    # Helper modules next to model.py are importable, as a user would expect.
    if folder not in sys.path:
        sys.path.insert(0, folder)
    spec = importlib.util.spec_from_file_location("mesh_custom_model", source)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {source}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    model_class = getattr(module, "Model", None)
    # inspect.isclass() is this same test, but its stub narrows to type[object], which takes no arguments.
    if not isinstance(model_class, type):
        raise TypeError(f"{source} defines no class Model")
    return PythonModel(model_class(path))


def _takes_parameters(method) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


class PythonModel:
    """Adapts a user's Model to the interface every format offers the worker."""

    def __init__(self, model: Any):
        if not callable(getattr(model, "predict", None)):
            raise TypeError("Model has no predict(inputs) method")
        self._model = model
        self._predict_takes_parameters = _takes_parameters(model.predict)

    def predict(self, inputs: dict, parameters: dict, requested_outputs: list[str]) -> dict:
        # The user's model returns all its outputs; v2.encode_response selects.
        if self._predict_takes_parameters:
            return self._model.predict(inputs, parameters)
        return self._model.predict(inputs)

    def metadata(self) -> dict | None:
        method = getattr(self._model, "metadata", None)
        return method() if callable(method) else None

    @property
    def handles_methods(self) -> bool:
        return callable(getattr(self._model, "handle", None))

    def handle(self, method: str, request: bytes) -> bytes:
        return self._model.handle(method, request)

    def close(self) -> None:
        method = getattr(self._model, "close", None)
        if callable(method):
            method()
