"""Custom python models (workers/formats/python.py): each distinct model.py compiled once."""

from __future__ import annotations

import traceback

import numpy as np
import pytest
from harness import write_model

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


@pytest.fixture(autouse=True)
def no_sources_held():
    assert python._compiled == {}, "an earlier test left a model open"
    yield
    assert python._compiled == {}, "every model closed gives its compiled source back"


def test_copies_of_one_source_share_its_compilation_until_the_last_closes(tmp_path):
    first, second = (python.load(write_model(str(tmp_path / name), FAILING_MODEL)) for name in "ab")
    other = python.load(write_model(str(tmp_path / "c"), FAILING_MODEL + "\n# another source\n"))
    assert sorted(holders for _, holders in python._compiled.values()) == [1, 2]
    first.close()
    assert sorted(holders for _, holders in python._compiled.values()) == [1, 1]
    second.close()
    other.close()


def test_a_copy_names_its_own_file_in_tracebacks(tmp_path):
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


def test_a_model_that_fails_to_load_holds_no_compiled_source(tmp_path):
    with pytest.raises(RuntimeError, match="cannot load"):
        python.load(write_model(str(tmp_path / "a"), REFUSING_MODEL))
    with pytest.raises(TypeError, match="no class Model"):
        python.load(write_model(str(tmp_path / "b"), "x = 1\n"))


def test_close_gives_the_source_back_even_when_the_models_close_raises(tmp_path):
    raising_close = FAILING_MODEL + "\n    def close(self):\n        raise OSError('busy')\n"
    model = python.load(write_model(str(tmp_path / "a"), raising_close))
    with pytest.raises(OSError):
        model.close()
    with pytest.raises(OSError):
        model.close()  # the model's own close runs again, but the source is given back once
