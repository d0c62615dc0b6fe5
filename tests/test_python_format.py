"""Custom python models (workers/formats/python.py): each distinct model.py compiled once."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import traceback

import numpy as np
import pytest
from harness import REPO, write_model

from workers.formats import python

FAILING_MODEL = """
class Model:
    def __init__(self, path):
        self.path = path

    def predict(self, inputs):
        raise ValueError("no")
"""

REFUSING_MODEL = """
class Model:
    def __init__(self, path):
        raise RuntimeError("cannot load")

    def predict(self, inputs):
        return inputs
"""


@pytest.fixture
def compiled():
    """How many sources the test's own loads keep compiled (other tests' models may still be held)."""
    before = set(python._compiled)
    yield lambda: len(set(python._compiled) - before)
    assert set(python._compiled) <= before, "every model closed forgets what its load compiled"


def test_a_source_is_compiled_once_and_kept_as_long_as_the_model_that_compiled_it(tmp_path, compiled):
    first, copy = (python.load(write_model(str(tmp_path / name), FAILING_MODEL)) for name in "ab")
    other = python.load(write_model(str(tmp_path / "c"), FAILING_MODEL + "\n# another source\n"))
    assert compiled() == 2
    copy.close()
    assert compiled() == 2, "a copy holds nothing of the bytes"
    first.close()
    assert compiled() == 1, "the bytes go with the model whose load compiled them"
    again = python.load(write_model(str(tmp_path / "d"), FAILING_MODEL))
    assert compiled() == 2, "the next copy compiles it anew, and keeps it"
    again.close()
    other.close()


def test_a_copy_runs_code_of_its_own(tmp_path, compiled):
    first, copy = (python.load(write_model(str(tmp_path / name), FAILING_MODEL)) for name in "ab")
    try:
        first_code, copy_code = (m._model.predict.__code__ for m in (first, copy))
        assert first_code is not copy_code and first_code.co_code == copy_code.co_code
    finally:
        first.close()
        copy.close()


def test_a_copy_names_its_own_file_in_tracebacks(tmp_path, compiled):
    paths = [write_model(str(tmp_path / name), FAILING_MODEL) for name in "ab"]
    models = [python.load(path) for path in paths]
    try:
        with pytest.raises(ValueError) as raised:
            models[1].predict({"x": np.zeros(1)}, {}, [])
        files = [frame.filename for frame in traceback.extract_tb(raised.value.__traceback__)]
        assert files[-1] == str(tmp_path / "b" / "model.py")
    finally:
        for model in models:
            model.close()


def test_a_model_that_fails_to_load_holds_no_compiled_source(tmp_path, compiled):
    with pytest.raises(RuntimeError, match="cannot load"):
        python.load(write_model(str(tmp_path / "a"), REFUSING_MODEL))
    with pytest.raises(TypeError, match="no class Model"):
        python.load(write_model(str(tmp_path / "b"), "x = 1\n"))


def test_close_forgets_the_source_even_when_the_models_close_raises(tmp_path, compiled):
    raising_close = FAILING_MODEL + "\n    def close(self):\n        raise OSError('busy')\n"
    model = python.load(write_model(str(tmp_path / "a"), raising_close))
    with pytest.raises(OSError):
        model.close()
    with pytest.raises(OSError):
        model.close()  # the model's own close runs again; the bytes were forgotten once


def test_each_model_file_runs_as_a_module_of_its_own_and_takes_it_with_it(tmp_path, compiled):
    sources = [write_model(str(tmp_path / name), FAILING_MODEL) for name in "ab"]
    names = [python.module_name(os.path.join(source, "model.py")) for source in sources]
    first, last = (python.load(source) for source in sources)
    try:
        assert names[0] != names[1]
        assert [sys.modules[name].__file__ for name in names] == [
            str(tmp_path / n / "model.py") for n in "ab"
        ]
        first.close()
        assert names[0] not in sys.modules and names[1] in sys.modules
    finally:
        last.close()
    assert not set(names) & set(sys.modules)


def test_two_loads_of_one_file_run_as_modules_of_their_own(tmp_path, compiled):
    source = write_model(str(tmp_path / "a"), FAILING_MODEL)
    first = python.load(source)
    name = python.module_name(os.path.join(source, "model.py"))  # what a next load would take
    second = python.load(source)
    try:
        assert name in sys.modules and name.endswith("_2")
        first.close()
        assert name in sys.modules, "the first copy's close took the second one's module"
    finally:
        second.close()
    assert name not in sys.modules


HELPED_MODEL = """
import helpers


class Model:
    def __init__(self, path):
        self.value = helpers.VALUE

    def predict(self, inputs):
        return {"value": helpers.VALUE}
"""


def helped_model(folder, value: int) -> str:
    path = write_model(str(folder), HELPED_MODEL)
    (folder / "helpers.py").write_text(f"VALUE = {value}\n")
    return path


def test_each_model_imports_the_helper_modules_beside_its_own_model_py(tmp_path, compiled):
    paths = {value: helped_model(tmp_path / f"m{value}", value) for value in (1, 2)}
    models = [python.load(paths[1]), python.load(paths[2])]
    models.append(python.load(paths[1]))  # its folder is on sys.path already, behind the other's
    try:
        assert [m._model.value for m in models] == [1, 2, 1]
        assert [m.predict({}, {}, [])["value"] for m in models] == [1, 2, 1]
        assert "helpers" not in sys.modules, "the models hold their helpers; the next load imports its own"
        assert not [f for f in sys.meta_path if isinstance(f, python._ImportsSeen)], "the load's finder went"
    finally:
        for model in models:
            model.close()


def test_a_packed_model_imports_nothing_from_any_models_folder(tmp_path, compiled):
    # The front packs only models with no modules beside model.py. Should it miss one, importing
    # it fails; on sys.path it would be found for every packed model that imports that name.
    before = list(sys.path)
    with pytest.raises(ModuleNotFoundError):
        python.load(helped_model(tmp_path / "missed", 1), shared=True)
    packed = python.load(write_model(str(tmp_path / "packed"), FAILING_MODEL), shared=True)
    try:
        assert sys.path == before, "a packed model's load changed sys.path"
    finally:
        packed.close()
    assert sys.path == before


def test_a_models_folder_leaves_sys_path_once_no_model_loaded_from_it_is_held(tmp_path, compiled):
    path, importers = list(sys.path), set(sys.path_importer_cache)
    folders = [write_model(str(tmp_path / f"m{i}"), FAILING_MODEL) for i in range(3)]
    models = [python.load(folder) for folder in [*folders, folders[0]]]
    with pytest.raises(ImportError):  # looks through every folder on sys.path
        importlib.import_module("helpers_that_no_folder_has")
    assert sys.path[:3] == [folders[0], folders[2], folders[1]]
    models[0].close()
    assert sys.path[0] == folders[0], "the other model loaded from it may still import from it"
    for model in models[1:]:
        model.close()
    assert sys.path == path and set(sys.path_importer_cache) == importers


def test_a_model_loaded_by_a_relative_path_takes_only_its_own_folder_off_sys_path(
    tmp_path, monkeypatch, compiled
):
    write_model(str(tmp_path / "m"), FAILING_MODEL)
    monkeypatch.chdir(tmp_path)
    path, importers = list(sys.path), set(sys.path_importer_cache)
    model = python.load(os.path.join("m", "model.py"))
    assert sys.path[0] == str(tmp_path / "m")
    model.close()
    assert sys.path == path and set(sys.path_importer_cache) >= importers


def test_a_folder_on_sys_path_before_its_model_loaded_stays_there(tmp_path, compiled):
    folder = write_model(str(tmp_path / "m"), FAILING_MODEL)
    sys.path.append(folder)
    try:
        python.load(folder).close()
        assert folder in sys.path
    finally:
        sys.path.remove(folder)


def test_warming_leaves_no_model_behind(compiled):
    path, modules = list(sys.path), set(sys.modules)
    python.warm()
    assert "mesh_warming_model" not in sys.modules
    assert not [name for name in set(sys.modules) - modules if name.startswith(python.MODULE_PREFIX)]
    assert sys.path == path and compiled() == 0


def test_warming_imports_what_loading_numpy_weights_needs_where_numpy_is_preloaded():
    check = """
import sys
import numpy
from workers.formats import python
assert "encodings.cp437" not in sys.modules
python.warm()
assert "encodings.cp437" in sys.modules  # an .npz archive's member names are read as cp437
"""
    subprocess.run([sys.executable, "-c", check], cwd=REPO, check=True, timeout=60)
