"""Who may import whom: read from the source, so a stray import fails here and not in production.

The front must not pull model code into its process, the workers must not depend on the front,
and plumbing/ serves both without depending on either.
"""

import ast
import os

import pytest
from harness import REPO

FRAMEWORKS = {"sklearn", "xgboost", "lightgbm", "onnxruntime", "onnx", "torch", "joblib"}
WORKER_MODULES_THE_FRONT_USES = {
    "workers",
    "workers.main",
    "workers.protocol",
    "workers.lanes",
    "workers.rings",
    "workers.formats",
}


def modules_of(package: str) -> list[str]:
    found = []
    for folder, _, files in os.walk(os.path.join(REPO, package)):
        found += [os.path.relpath(os.path.join(folder, name), REPO) for name in files if name.endswith(".py")]
    return sorted(found)


def imports_of(path: str) -> set[str]:
    """Every module a file imports, anywhere in it (lazy imports inside functions included)."""
    with open(os.path.join(REPO, path)) as source:
        tree = ast.parse(source.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def _top(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize("path", modules_of("workers"))
def test_workers_never_import_the_front(path):
    assert not {m for m in imports_of(path) if _top(m) == "runtime"}, path


@pytest.mark.parametrize("path", modules_of("plumbing"))
def test_plumbing_imports_neither_side(path):
    assert not {m for m in imports_of(path) if _top(m) in ("runtime", "workers")}, path


@pytest.mark.parametrize("path", modules_of("runtime"))
def test_the_front_imports_no_model_code(path):
    imported = imports_of(path)
    frameworks = {m for m in imported if _top(m) in FRAMEWORKS}
    assert not frameworks, f"{path} imports {frameworks}"
    # "from workers import protocol" adds both workers and workers.protocol; any module of the
    # workers beyond the four the front needs is model code or the worker's loop.
    worker_modules = {m for m in imported if _top(m) == "workers"}
    assert worker_modules <= WORKER_MODULES_THE_FRONT_USES, f"{path} imports {worker_modules}"


def test_the_walk_sees_imports_inside_functions():
    assert "uvloop" in imports_of("runtime/server.py")  # imported lazily in event_loop_factory


@pytest.mark.parametrize("path", modules_of("runtime") + modules_of("workers"))
def test_no_module_of_the_front_or_the_workers_is_over_400_lines(path):
    with open(os.path.join(REPO, path)) as source:
        lines = len(source.read().splitlines())
    assert lines <= 400, f"{path} has {lines} lines: split it by concept"
