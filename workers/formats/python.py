"""Custom Python models: a model.py that defines `class Model`.

The worker calls `Model(path)` (path = the modelPath it was given; the
constructor loads), then `predict(inputs)` or `predict(inputs, parameters)`
with `inputs: dict[str, numpy.ndarray]`, expecting `dict[str, numpy.ndarray]`
back; inputs sent raw are read-only views of the request (not copied).
Optional methods: `metadata()`, `handle(method, request_bytes)`, `close()`.

A pack often holds many copies of one model.py (a model per tenant, say),
and compiling the source was much of what loading a tiny model cost. So a
worker keeps each source it compiled, marshalled, for as long as the model
whose load compiled it is held; a copy loads from those bytes, into code of
its own named after its own file (tracebacks point at it). Each model's drop
gives back what its load added: the bytes go with the model that paid for
them, and no model runs code another one holds.
"""

from __future__ import annotations

import collections
import hashlib
import importlib.util
import inspect
import io
import itertools
import marshal
import os
import sys
import types
from collections.abc import Callable
from typing import Any

MODULE_PREFIX = "mesh_custom_model_"
# Compiled model.py sources, marshalled, by their content's digest.
_compiled: dict[bytes, bytes] = {}
# Model folders on sys.path, by how many held models were loaded from each; and those of them
# that were on sys.path before any model from them loaded.
_folders_held: collections.Counter[str] = collections.Counter()
_folders_found_on_path: set[str] = set()


def module_name(source: str) -> str:
    """The module a model.py runs as, one per file and load: in a pack, a class its code defines is
    found through sys.modules by that name (pickle does so), which must not lead to another
    model's, nor go with another copy of the same file (a model loaded under two ids)."""
    name = f"{MODULE_PREFIX}{hashlib.sha256(os.path.abspath(source).encode()).hexdigest()[:16]}"
    copies = (f"{name}_{n}" for n in itertools.count(2))
    return name if name not in sys.modules else next(copy for copy in copies if copy not in sys.modules)


def load(path: str, shared: bool = False) -> PythonModel:
    """The model at `path`; `shared` (in a pack): its folder is not put on sys.path."""
    source = os.path.join(path, "model.py") if os.path.isdir(path) else path
    folder = os.path.dirname(os.path.abspath(source))
    spec = importlib.util.spec_from_file_location(module_name(source), source)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {source}")
    code, forget_compiled = _code_of(source)
    # Helper modules next to model.py are importable, as a user would expect. Such a model gets a
    # worker of its own (the front's ModelSpec.brings_modules): in a pack, a module imported after
    # the load would come from whichever model's folder is first on sys.path. So a pack puts no
    # model's folder there: should the front miss a module, importing it fails, and the model with it.
    if not shared:
        _hold_on_path(folder)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module

    def forget() -> None:
        """What the drop gives back: the module, if no later load of that file took its name,
        the folder's place on sys.path, and the bytes."""
        if sys.modules.get(spec.name) is module:
            del sys.modules[spec.name]
        if not shared:
            _release_from_path(folder)
        if forget_compiled is not None:
            forget_compiled()

    imports = _ImportsSeen()
    sys.meta_path.insert(0, imports)
    try:
        exec(code, module.__dict__)
        model_class = getattr(module, "Model", None)
        # inspect.isclass() is this same test, but its stub narrows to type[object], which takes no arguments.
        if not isinstance(model_class, type):
            raise TypeError(f"{source} defines no class Model")
        return PythonModel(model_class(path), on_close=forget)
    except BaseException:
        forget()
        raise
    finally:
        if imports in sys.meta_path:  # the model's code may have rearranged it
            sys.meta_path.remove(imports)
        _unregister_modules_of(folder, imports.names)


class _ImportsSeen:
    """A finder that finds nothing, first on sys.meta_path: it sees the name of every module
    imported anew (one already in sys.modules asks no finder)."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, name: str, path=None, target=None) -> None:
        self.names.append(name)


def _unregister_modules_of(folder: str, names: list[str]) -> None:
    """Takes the modules this load imported from `folder` out of sys.modules: the model holds
    them, and the next model's `import helpers` must find its own helpers.py, not this one."""
    inside = os.path.join(os.path.abspath(folder), "")
    for name in names:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file and os.path.abspath(file).startswith(inside):
            del sys.modules[name]


def _hold_on_path(folder: str) -> None:
    """Puts `folder` first on sys.path, where it stays while a model loaded from it is held."""
    if folder not in _folders_held and folder in sys.path:
        _folders_found_on_path.add(folder)  # put there by someone else: it stays
    if folder in sys.path:
        sys.path.remove(folder)
    sys.path.insert(0, folder)
    _folders_held[folder] += 1


def _release_from_path(folder: str) -> None:
    """Takes `folder` off sys.path once no model loaded from it is held: a pack loads and drops
    thousands of models in its life, and every import of a module not yet loaded looks through
    each folder on sys.path."""
    _folders_held[folder] -= 1
    if _folders_held[folder] > 0:
        return
    del _folders_held[folder]
    if folder in _folders_found_on_path:
        _folders_found_on_path.discard(folder)
        return
    if folder in sys.path:
        sys.path.remove(folder)
    inside = os.path.join(folder, "")
    gone = [e for e in sys.path_importer_cache if (e == folder or e.startswith(inside)) and e not in sys.path]
    for entry in gone:  # the folder's finders, and those of its subfolders no other model holds
        del sys.path_importer_cache[entry]


def _code_of(source: str) -> tuple[types.CodeType, Callable[[], None] | None]:
    """`source`'s code, named after it; and where this load compiled it, what forgets the bytes
    kept for copies (run when its model closes)."""
    with open(source, "rb") as file:
        content = file.read()
    digest = hashlib.blake2b(content, digest_size=16).digest()
    marshalled = _compiled.get(digest)
    if marshalled is not None:
        return _named(marshal.loads(marshalled), source), None
    code = compile(content, source, "exec", dont_inherit=True)
    _compiled[digest] = marshal.dumps(code)

    def forget() -> None:
        del _compiled[digest]

    return code, forget


def _named(code: types.CodeType, filename: str) -> types.CodeType:
    """`code`, with every function and class body in it, naming `filename` as its file."""
    if code.co_filename == filename:
        return code
    consts = tuple(_named(c, filename) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_filename=filename, co_consts=consts)


_WARMING_SOURCE = """
class Model:
    def __init__(self, path):
        self.path = path

    def predict(self, inputs):
        return dict(inputs)
"""


def warm() -> None:
    """Fork server: runs once what a model's first load runs (a module made from a file's spec, a
    source compiled and run, the adapter's signature check, numpy's .npy and .npz loading where the
    fork server imported numpy), so that each worker finds those imported and their caches filled
    instead of writing them itself."""
    spec = importlib.util.spec_from_file_location("mesh_warming_model", os.path.join(os.sep, "model.py"))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    exec(compile(_WARMING_SOURCE, "<warming>", "exec", dont_inherit=True), module.__dict__)
    model = PythonModel(module.Model(""))
    model.predict({}, {}, [])
    model.close()
    if "numpy" in sys.modules:  # preloaded (WORKER_PRELOAD); never imported for this
        _load_weights_as_models_do()


def _load_weights_as_models_do() -> None:
    import numpy as np

    for save in (np.save, np.savez):
        saved = io.BytesIO()
        save(saved, np.zeros(3))
        saved.seek(0)
        loaded = np.load(saved)
        if not isinstance(loaded, np.ndarray):
            loaded.close()  # an .npz archive


def _takes_parameters(method) -> bool:
    try:
        params = inspect.signature(method).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in params)


class PythonModel:
    """Adapts a user's Model to the interface every format offers the worker."""

    def __init__(self, model: Any, on_close=None):
        """on_close() runs once, after the model's own close()."""
        if not callable(getattr(model, "predict", None)):
            raise TypeError("Model has no predict(inputs) method")
        self._model = model
        self._on_close = on_close
        self._predict_takes_parameters = _takes_parameters(model.predict)

    def predict(self, inputs: dict, parameters: dict, requested_outputs: list[str]) -> dict:
        # The user's model returns all its outputs; responses.encode_response selects.
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
        on_close, self._on_close = self._on_close, None
        try:
            method = getattr(self._model, "close", None)
            if callable(method):
                method()
        finally:
            if on_close is not None:
                on_close()
