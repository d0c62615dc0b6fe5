"""The test suite's name for meshtest.harness, where the mesh-like client lives (see there).

The tests import `from harness import ...`; this keeps those imports as they are while the
demo and the benchmarks import meshtest.harness directly.
"""

from meshtest.harness import (
    ECHO_MODEL,
    REPO,
    MiB,
    Runtime,
    alive,
    allocating_model,
    expect_status,
    free_port,
    mesh_headers,
    metric_sample,
    scrape_metrics,
    status_of,
    tree,
    tree_uss,
    uss,
    wait_until,
    write_model,
)

__all__ = [
    "ECHO_MODEL",
    "REPO",
    "MiB",
    "Runtime",
    "alive",
    "allocating_model",
    "expect_status",
    "free_port",
    "mesh_headers",
    "metric_sample",
    "scrape_metrics",
    "status_of",
    "tree",
    "tree_uss",
    "uss",
    "wait_until",
    "write_model",
]
