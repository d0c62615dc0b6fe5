"""What a worker is told as it starts: the fields workers/main.py reads, from the front's settings."""

from __future__ import annotations

import os

from plumbing import lifeline
from runtime import heartbeat
from runtime.settings import Settings

# A worker that cannot watch the front through a pidfd checks this often that the front
# still runs, and exits once it is gone: a backstop behind the parent-death signal.
FRONT_CHECK_SECONDS = 10.0


def worker_config(
    settings: Settings, identity: bytes, addresses: tuple[str, str | None], beats: str, beat_slot: int
) -> dict:
    """The start configuration of the worker `identity`: the worker socket's address and the call
    lanes' (None: no lane), the beat file `beats` and its slot there, and what the settings say
    workers do."""
    return {
        "address": addresses[0],
        "lanes": addresses[1],
        "identity": identity,
        "heartbeat_timeout": FRONT_CHECK_SECONDS,
        "beats": beats,
        "beat_slot": beat_slot,
        "beat_ms": heartbeat.idle_beat_ms(settings.worker_heartbeat_timeout_ms),
        "front": lifeline.process_identity(os.getpid()),
        "threads": settings.worker_threads,
        "batch_max": settings.worker_batch_max,
        "batch_wait": settings.worker_batch_wait_us / 1e6,
        "sched_batch": settings.worker_sched_batch,
        "runtime_dir": settings.runtime_dir,
        "log_level": settings.log_level,
        "log_format": settings.log_format,
    }
