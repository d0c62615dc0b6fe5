"""Preloaded by a test into the fork server (WORKER_PRELOAD): every worker it forks exits at once."""

import os

os.register_at_fork(after_in_child=lambda: os._exit(3))
