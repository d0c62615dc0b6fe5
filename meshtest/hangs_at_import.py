"""Preloaded by a test into every fork server (WORKER_PRELOAD): in the fork server of the group
MESH_TEST_HANG_GROUP names, the import waits while the file MESH_TEST_HANG_MARKER names exists, as
a fork server started again would on a stalled disk."""

import os
import time

if os.environ.get("MESH_FORKSERVER_GROUP") == os.environ.get("MESH_TEST_HANG_GROUP"):
    while os.path.exists(os.environ.get("MESH_TEST_HANG_MARKER", "")):
        time.sleep(0.05)
