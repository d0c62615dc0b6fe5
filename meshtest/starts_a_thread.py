"""Preloaded by a test into the fork server (WORKER_PRELOAD): starts a thread as it is imported, as a
library with a background thread pool does."""

import threading

STOP = threading.Event()
threading.Thread(target=STOP.wait, name="preloaded", daemon=True).start()
