"""How a worker logs the exceptions its models raise while serving calls.

A model that raises in every call would write a traceback per call: megabytes a second at
thousands of calls a second, drowning every other model's lines. The first exception of a kind
(model and exception type) is logged at once with its traceback; the same kind again within
REPEAT_SECONDS is only counted, and the count is told with the next one logged. Each call's
client still gets the error, and mesh_requests_total counts every one.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("mesh.worker")

REPEAT_SECONDS = 10.0
# Kinds remembered at most: a model making up exception types cannot grow the table for ever.
KINDS_MAX = 1024


class RaisedLog:
    def __init__(self):
        self._kinds: dict[tuple[str, str], list] = {}  # (model, type) -> [last logged at, not logged since]

    def note(self, model_id: str, method: str, error: BaseException) -> None:
        key = (model_id, type(error).__qualname__)
        now = time.monotonic()
        seen = self._kinds.get(key)
        if seen is not None and now - seen[0] < REPEAT_SECONDS:
            seen[1] += 1
            return
        if seen is None and len(self._kinds) >= KINDS_MAX:
            self._kinds.clear()
        unlogged = seen[1] if seen is not None else 0
        self._kinds[key] = [now, 0]
        since = f"; {unlogged} calls raised {key[1]} since it was last logged" if unlogged else ""
        log.error(
            "model %s raised while serving %s%s",
            model_id,
            method,
            since,
            exc_info=error,
            extra={"model_id": model_id},
        )
