"""A worker's slot of the beat file (runtime/beats.py, the layout in workers/protocol.py).

Every wake of the worker's loop stamps the slot with the time, and an idle
worker wakes every `beat_ms` only for that: the front reads the stamps to find
hung workers (runtime/heartbeat.py) without a message crossing the socket. A
pack's main thread also writes there which model's call or load it runs, so
that a pack's death counts against that model alone (runtime/packs.py
blamed()).
"""

from __future__ import annotations

import time
from typing import Any

from workers import protocol

# How often an idle worker beats when the config does not say; the pool passes
# a fraction of WORKER_HEARTBEAT_TIMEOUT_MS.
BEAT_MS = 5000
# Idle workers beat in groups of BEAT_GROUP slots, each group at the same
# instants: waking many processes at once costs each a fraction of waking it
# alone, and groups BEAT_GROUP_GAP_MS apart keep every burst short.
BEAT_GROUP = 250
BEAT_GROUP_GAP_MS = 100


class BeatSlot:
    def __init__(self, config: dict[str, Any]):
        self.beat_ms = config.get("beat_ms", BEAT_MS)
        self.slot = config.get("beat_slot", 0)
        self._fields = protocol.map_beats(config.get("beats"))
        self._beat = protocol.beat_index(self.slot)
        self._running = protocol.running_index(self.slot)

    def beat(self) -> float:
        """Stamps the slot with the time, which it returns: the front reads it."""
        now = time.monotonic()
        self._fields[self._beat] = now
        return now

    def mark_running(self, model_id: str | None) -> None:
        """Says which model's code the worker's main thread runs now (None: none)."""
        self._fields[self._running] = protocol.model_tag(model_id) if model_id else protocol.NOTHING_RUNNING

    def ms_to_next_beat(self) -> int:
        """Until the next instant of this slot's group: every beat_ms, shifted by the group's gap."""
        shift = self.slot // BEAT_GROUP * BEAT_GROUP_GAP_MS
        # + 1: zmq_poll may end a fraction of a millisecond early, which must not cost a second wake.
        return self.beat_ms - (int(time.monotonic() * 1000) - shift) % self.beat_ms + 1
