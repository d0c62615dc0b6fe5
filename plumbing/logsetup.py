"""Log set-up shared by the front and the workers (both write to stderr).

Text: one line per event. LOG_FORMAT=json: one JSON object per line with
time, level, process role, pid, message, and model_id when the event concerns
a model (pass it as `extra={"model_id": ...}`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

# A traceback in the log keeps its first and last characters: an exception may carry megabytes
# (model code raising with a data frame in its message), written again on every failed call.
TRACEBACK_HEAD_CHARS = 12_288
TRACEBACK_TAIL_CHARS = 4096


def bounded_traceback(text: str) -> str:
    left_out = len(text) - TRACEBACK_HEAD_CHARS - TRACEBACK_TAIL_CHARS
    if left_out <= 0:
        return text
    head, tail = text[:TRACEBACK_HEAD_CHARS], text[-TRACEBACK_TAIL_CHARS:]
    return f"{head}\n... ({left_out} characters left out) ...\n{tail}"


class TextFormatter(logging.Formatter):
    def formatException(self, ei) -> str:
        return bounded_traceback(super().formatException(ei))


class JsonFormatter(logging.Formatter):
    def __init__(self, role: str):
        super().__init__()
        self.role = role

    def formatException(self, ei) -> str:
        return bounded_traceback(super().formatException(ei))

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "role": self.role,
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        }
        model_id = getattr(record, "model_id", None)
        if model_id is not None:
            entry["model_id"] = model_id
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry)


# How the front hands its LOG_LEVEL and LOG_FORMAT to the fork server: "LEVEL FORMAT".
LOG_ENV = "MESH_RUNTIME_LOG"


def setup_from_env(role: str) -> None:
    """setup() with what the front put in LOG_ENV; nothing if it put nothing there."""
    level, _, fmt = os.environ.get(LOG_ENV, "").partition(" ")
    if level and fmt:
        setup(role, level, fmt)


def setup(role: str, level: str, fmt: str) -> None:
    """Routes every logger to stderr in the chosen format; replaces earlier handlers."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(
            TextFormatter(f"%(asctime)s %(levelname)s {role}[%(process)d] %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # setLevel clears the cache of every logger there is (the frameworks make
    # hundreds), and in a forked worker that writes to each one's pages: skip
    # it when the fork server already set this level.
    if root.level != logging.getLevelName(level.upper()):
        root.setLevel(level.upper())
