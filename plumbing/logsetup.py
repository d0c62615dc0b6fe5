"""Log set-up shared by the front and the workers (both write to stderr).

Text: one line per event. LOG_FORMAT=json: one JSON object per line with
time, level, process role, pid, message, and model_id when the event concerns
a model (pass it as `extra={"model_id": ...}`; in a worker, records that name
none name the model the thread runs). Under json, what Python code prints
(model code's print(), warnings) comes out as JSON objects too, and an uncaught
exception as one ERROR record with its traceback; what C code writes straight
to fds 1 and 2 does not.
"""

from __future__ import annotations

import io
import json
import logging
import os
import sys
import threading
import time

# In a worker, the model whose code this thread runs (workers/loop.py mark_running()): the
# model_id of records that name none, such as those of the model's own loggers and prints.
running = threading.local()

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
        model_id = getattr(record, "model_id", None) or getattr(running, "model_id", None)
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
    handler = logging.StreamHandler(_unwrapped(sys.stderr))
    if fmt == "json":
        handler.setFormatter(JsonFormatter(role))
        _log_what_python_prints()
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


# Printed lines go out in pieces of at most this many characters: a line never ended (a progress
# bar redrawn with "\r") must not grow without end.
PRINTED_PIECE_CHARS = 8192


class Printed(io.TextIOBase):
    """sys.stdout or sys.stderr under LOG_FORMAT=json: each line written becomes a log record of
    logger `name` (the raw line would be the one thing in the log that is not JSON)."""

    def __init__(self, name: str, level: int, original):
        self.logger = logging.getLogger(name)
        self.level = level
        self.original = original
        self._local = threading.local()  # each thread's unended line: threads' prints do not mix

    def write(self, text: str) -> int:
        local = self._local
        if getattr(local, "writing", False):  # logging's own complaint about a failed write
            return self.original.write(text)
        pending = getattr(local, "pending", "") + text
        *lines, pending = pending.split("\n")
        while len(pending) > PRINTED_PIECE_CHARS:
            lines.append(pending[:PRINTED_PIECE_CHARS])
            pending = pending[PRINTED_PIECE_CHARS:]
        local.pending = pending
        local.writing = True
        try:
            for line in lines:
                for start in range(0, max(len(line), 1), PRINTED_PIECE_CHARS):
                    self._log(line[start : start + PRINTED_PIECE_CHARS].rstrip("\r"))
        finally:
            local.writing = False
        return len(text)

    def _log(self, line: str) -> None:
        # Not log(): what is printed is not dropped under LOG_LEVEL, as it is not in text. Nor
        # handle(): a model's logging.config.dictConfig() disables the loggers it does not name,
        # this one among them, and every print would be lost from then on.
        logger = self.logger
        logger.callHandlers(logger.makeRecord(logger.name, self.level, "", 0, "%s", (line,), None))

    def flush(self) -> None:
        if getattr(self._local, "pending", ""):
            self.write("\n")
        # What went out raw (to .buffer; a handler's write through this stream) is still in the
        # real stream's buffer, which a worker's os._exit() after this flush would lose.
        self.original.flush()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.original.fileno()

    @property  # read-only in io's base class, whatever typeshed says
    def encoding(self):  # type: ignore[override]
        return self.original.encoding

    @property
    def buffer(self):  # bytes written there go out raw, as from C code
        return self.original.buffer

    def __getattr__(self, name: str):  # the rest of a real stream's (name, reconfigure(), ...)
        return getattr(self.original, name)


def names_models() -> bool:
    """Whether records name the model a thread runs (JSON's `model_id`): only then need a worker
    note it for every call, which costs it a thread-local write (about 1 % of an echo call's
    instructions)."""
    return any(isinstance(handler.formatter, JsonFormatter) for handler in logging.getLogger().handlers)


def _unwrapped(stream):
    return stream.original if isinstance(stream, Printed) else stream


def _log_what_python_prints() -> None:
    logging.captureWarnings(True)
    for name, level in (("stdout", logging.INFO), ("stderr", logging.WARNING)):
        if not isinstance(getattr(sys, name), Printed):
            setattr(sys, name, Printed(name, level, getattr(sys, name)))
    # Python would print these tracebacks to stderr, a WARNING record per line: one ERROR instead.
    threading.excepthook = _log_thread_exception
    sys.excepthook = _log_uncaught_exception


def _log_thread_exception(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:  # as Python's own hook: a thread's sys.exit() is no error
        return
    name = args.thread.name if args.thread is not None else "a thread"
    # The exception itself: logging reads its type and traceback from it.
    logging.getLogger("threading").error("uncaught exception in %s", name, exc_info=args.exc_value)


def _log_uncaught_exception(exc_type, exc_value, exc_traceback) -> None:
    logging.getLogger("main").error("uncaught exception", exc_info=(exc_type, exc_value, exc_traceback))
