"""docs/architecture.md names only modules, classes and functions that exist."""

import importlib
import os
import re

import pytest
from harness import REPO

DOTTED = re.compile(r"`((?:runtime|workers|protos)(?:\.\w+)+)`")


def _names_in(path: str) -> list[str]:
    with open(os.path.join(REPO, path)) as doc:
        return sorted(set(DOTTED.findall(doc.read())))


def _resolve(dotted: str):
    """The object a dotted name stands for: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


def test_architecture_names_enough_of_the_code_to_follow_a_call():
    assert len(_names_in("docs/architecture.md")) > 60


@pytest.mark.parametrize("dotted", _names_in("docs/architecture.md"))
def test_every_name_in_the_architecture_exists(dotted):
    try:
        _resolve(dotted)
    except (ImportError, AttributeError) as error:
        pytest.fail(f"docs/architecture.md names {dotted}, which does not exist: {error}")


def test_the_readme_is_a_users_document_under_300_lines():
    with open(os.path.join(REPO, "README.md")) as readme:
        assert len(readme.read().splitlines()) < 300
