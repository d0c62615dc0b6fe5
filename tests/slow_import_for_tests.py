"""Preloaded by the fork server in test_starting_until_the_pool_is_ready: a slow framework import,
which lasts until the file MESH_TEST_IMPORT_GATE names exists (60 s at most)."""

import os
import time

_deadline = time.monotonic() + 60
while not os.path.exists(os.environ.get("MESH_TEST_IMPORT_GATE", "")) and time.monotonic() < _deadline:
    time.sleep(0.01)
