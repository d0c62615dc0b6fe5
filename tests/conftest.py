import re

import pytest
from harness import Runtime

from meshtest import cgroup


@pytest.fixture(scope="module")
def runtime(request):
    """One runtime shared by a test module (loads time out after 5 s there).

    Its fork server preloads only numpy, unless the module is about model
    formats and says PRELOAD_FRAMEWORKS = True.
    """
    preload = getattr(request.module, "PRELOAD_FRAMEWORKS", False)
    with Runtime(LOADTIME_TIMEOUT="5000", WORKERS_WARM="1", preload_frameworks=preload) as shared:
        yield shared


@pytest.fixture
def rt(runtime):
    """The shared runtime, checked to hold no model before and after the test."""
    assert runtime.model_workers() == 0, "an earlier test left a model loaded"
    yield runtime
    assert runtime.process.poll() is None, f"runtime died:\n{runtime.log()}"


@pytest.fixture
def meter(request):
    """A memory cgroup of its own for the test's runtime (meshtest/cgroup.py), removed afterwards."""
    meter = cgroup.Meter(re.sub(r"[^A-Za-z0-9_-]", "-", request.node.name)[:40])
    yield meter
    meter.remove()
