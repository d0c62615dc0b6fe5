"""multiprocessing's fork server, as the front uses it: started once, stopped at the end.

The fork server imports WORKER_PRELOAD and the worker code once
(workers/preload.py), then forks every worker, so a new worker starts in
milliseconds with a few MiB of its own memory. multiprocessing offers no
public call to learn its pid or to stop it; both are read from its private
fields, as its own tests do.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os

from plumbing import logsetup, titles
from workers import protocol

log = logging.getLogger("mesh.forkserver")


def start(
    context: multiprocessing.context.BaseContext,
    preload: tuple[str, ...],
    runtime_dir: str,
    log_settings: tuple[str, str],
) -> int | None:
    """Starts the fork server; its pid, or None if multiprocessing hides it.

    Call it on the main thread: the fork server's parent-death signal follows
    the thread that started it. The resource tracker (the front's other
    child) is not named here: it cannot carry our title, so a later front's
    purge could never tell it from a stranger's process, and it exits by
    itself once the front, the fork server and the workers are gone (the
    last end of its pipe closes).
    """
    os.environ[protocol.PRELOAD_ENV] = ",".join(preload)
    os.environ[titles.RUNTIME_DIR_ENV] = runtime_dir  # for the fork server's title
    # The fork server sets the workers' log level once for all of them: set in
    # each worker, it would copy every logger's page (plumbing/logsetup.py).
    os.environ[logsetup.LOG_ENV] = " ".join(log_settings)
    context.set_forkserver_preload(["workers.preload"])
    multiprocessing.forkserver.ensure_running()
    return getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)


def forget(process: multiprocessing.process.BaseProcess) -> None:
    """Drops a started worker from multiprocessing's own list of children.

    multiprocessing keeps every process it started in a set and polls each
    member (a select() on its sentinel) every time it starts another, so a
    start would cost more with every model loaded. The pool watches and joins
    its workers itself, so the set only slows it down.
    """
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]


def stop() -> None:
    """Stops and reaps the fork server and the resource tracker.

    Both would also exit on their own once this process is gone.
    """
    for helper in (
        getattr(multiprocessing.forkserver, "_forkserver", None),
        getattr(multiprocessing.resource_tracker, "_resource_tracker", None),
    ):
        stop_helper = getattr(helper, "_stop", None)
        if stop_helper is not None:
            try:
                stop_helper()
            except (OSError, ChildProcessError) as error:
                log.warning("stopping a multiprocessing helper: %s", error)
