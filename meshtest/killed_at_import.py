"""Preloaded by a test into a fork server (WORKER_PRELOAD): the fork server is killed as it imports
it, as by a native library that crashes or the OOM killer."""

import os
import signal

os.kill(os.getpid(), signal.SIGKILL)
