"""multiprocessing's fork servers, as the front uses them: one per framework family, and a base one.

A fork server imports numpy, the worker code and one framework (or family of
frameworks) once (workers/preload.py), then forks the workers of their
formats, so a new worker starts in milliseconds with a few MiB of its own
memory. All are started with the pool, before the runtime says it is ready:
the capacity it reports then already holds them. Not one fork server for
all frameworks: every fork copies the page-table entries of the fork
server's private memory, and the front's measurement of each worker walks
them again: a python model's worker forked from a fork
server that had also imported torch, onnxruntime and scikit-learn took
longer to fork and to measure, and mapped many more regions (docs/density.md).
The "base" fork server, started with the pool, imports no framework: it
forks the workers of python models, and of any format whose framework is not
in WORKER_PRELOAD (such a worker imports the framework itself).

multiprocessing has one fork server per process and offers no public call to
run another, learn its pid or stop it. Each ForkServer here is an instance of
its class. multiprocessing's module-level connect function, which
Process.start() calls, is replaced once by one that goes to the fork server
the calling thread names (`_here`): starts from different fork servers run at
once, each on its own thread (runtime/spawning.py), and one that waits for
its fork server's import holds up no other. A fork server that starts reads
its settings from os.environ, which the whole process shares: those are set,
and the fork server started, under one lock. That start is a fork and an exec;
the import it then runs, the long part, is outside the lock.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing.forkserver
import multiprocessing.process
import multiprocessing.resource_tracker
import os
import signal
import threading
import time

from plumbing import lifeline, logsetup, titles
from runtime import status
from runtime.leftovers import ProcessRegistry
from workers import formats, protocol

log = logging.getLogger("mesh.forkserver")

BASE_GROUP = "base"
# How long stop() waits for each fork server (and the resource tracker) before SIGKILL.
STOP_SECONDS = 5.0
# How long a fork server that runs may take to fork a worker, and one starting to import what it
# preloads and fork its first, before it is taken for hung and SIGKILLed (then started again).
FORK_SECONDS = 10.0
PRELOAD_SECONDS = 120.0
START_ATTEMPTS = 3  # a fork server that dies as it starts, at start-up, is started again
RESTART_PAUSE_SECONDS = 0.2
FRAMEWORKS = frozenset(fmt.framework for fmt in formats.FORMATS if fmt.framework)
# Frameworks that share one fork server: xgboost and lightgbm import scipy and
# scikit-learn themselves, so fork servers of their own would each hold
# another copy of that stack (docs/density.md).
FAMILIES = (("sklearn", "xgboost", "lightgbm"),)

_here = threading.local()  # .server: the fork server that a start on this thread goes to
_environ = threading.Lock()  # held while a fork server's settings are in os.environ and it starts
_default_connect = multiprocessing.forkserver.connect_to_new_process


def group_for(format_name: str, preload: tuple[str, ...]) -> str:
    """The fork server for workers of `format_name`: its framework's if preloaded, else the base one.

    A framework's fork server is named by the frameworks it imports, joined
    by "+" (e.g. "sklearn+xgboost+lightgbm", "torch").
    """
    fmt = formats.by_name(format_name)
    framework = fmt.framework if fmt is not None else None
    if framework is None or framework not in preload:
        return BASE_GROUP
    family = next((family for family in FAMILIES if framework in family), (framework,))
    return "+".join(member for member in family if member in preload)


def _connect_here(fds):
    """multiprocessing's connect_to_new_process, sent to the fork server this thread's start names."""
    server = getattr(_here, "server", None)
    return (server.connect_to_new_process if server is not None else _default_connect)(fds)


class _GroupServer(multiprocessing.forkserver.ForkServer):
    """multiprocessing's fork server, started (here, or by multiprocessing when the one before
    died) with its group's settings in os.environ, where it reads them as it starts. They are
    taken out again after: nothing else in the front's process, or started from it, may read a
    group's settings (tests that import workers.preload would import that group's preload)."""

    def __init__(self, environment: dict[str, str]):
        super().__init__()
        self.set_forkserver_preload(["workers.preload"])
        self._environment = environment

    def ensure_running(self) -> None:
        with _environ:
            before = {name: os.environ.get(name) for name in self._environment}
            os.environ.update(self._environment)
            try:
                super().ensure_running()
            finally:
                for name, value in before.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value


class ForkServers:
    """The fork servers of one pool. Its methods may be called from several threads: a group's
    starts from a thread of its own, the rest from the pool's.

    The thread that starts a fork server is its parent thread, whose end fires its parent-death
    signal (workers/preload.py): every such thread must live as long as the pool.
    """

    def __init__(
        self,
        preload: tuple[str, ...],
        runtime_dir: str,
        log_settings: tuple[str, str],
        records: ProcessRegistry,
    ):
        self._preload = preload
        self._common = tuple(module for module in preload if module not in FRAMEWORKS)
        self._runtime_dir = runtime_dir
        self._log_settings = log_settings
        # The pool's ProcessRegistry: told each fork server's pid as it starts, and as it is reaped.
        self._records = records
        self._servers: dict[str, multiprocessing.forkserver.ForkServer] = {}
        self._pids: dict[str, int] = {}
        self._identities: dict[str, tuple[int, int] | None] = {}  # lifeline.process_identity()
        # Each group's fork server once it has forked: one started (or started again) since may
        # still be importing what it preloads, which takes far longer than a fork.
        self._forked: dict[str, tuple[int, int] | None] = {}
        self._dead: set[tuple[int, int]] = set()  # the identities of those that died, reaped
        # Held while a group's fork server is looked at and started again, and while its pid is
        # noted: a start of its worker and a reap of another may both find it dead.
        self._books = threading.RLock()
        multiprocessing.forkserver.connect_to_new_process = _connect_here

    def groups(self) -> tuple[str, ...]:
        """The base fork server, then one per framework (or family of them) in WORKER_PRELOAD."""
        groups = [BASE_GROUP]
        for fmt in formats.FORMATS:
            group = group_for(fmt.name, self._preload)
            if group not in groups:
                groups.append(group)
        return tuple(groups)

    def preload_of(self, group: str) -> tuple[str, ...]:
        return self._common if group == BASE_GROUP else (*self._common, *group.split("+"))

    def start_all(self) -> None:
        """Starts every group's fork server and waits until each has imported what it preloads (a
        child forked from it, which exits at once, comes only then): the front reads what they
        cost when it reports its capacity, which with no warm spare would come before any ran."""
        for group in self.groups():
            for attempt in range(1, START_ATTEMPTS + 1):
                probe = multiprocessing.get_context("forkserver").Process(target=os.getpid, name="mesh-probe")
                try:
                    self.start_process(group, probe)
                except (EOFError, OSError) as error:  # it died importing (the OOM killer, a crashing library)
                    time.sleep(RESTART_PAUSE_SECONDS)  # till it is a zombie: until then it looks alive
                    preloads = ", ".join(self.preload_of(group))
                    died = f"{error!r}, {self._exit_status(group)}; it preloads {preloads}"
                    if attempt == START_ATTEMPTS:
                        raise RuntimeError(
                            f"the {group} fork server died as it started {attempt} times in a row ({died}): "
                            "take what it cannot import out of WORKER_PRELOAD"
                        ) from error
                    log.warning("the %s fork server died as it started (%s); starting it again", group, died)
                    continue
                probe.join(timeout=PRELOAD_SECONDS)
                probe.close()
                break

    def _exit_status(self, group: str) -> str:
        """How the group's fork server ended, dead as it started (left unreaped: multiprocessing
        reaps it as it starts another); its stderr went to the front's, unless it crashed silently."""
        pid = getattr(self._servers.get(group), "_forkserver_pid", None)
        try:
            ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) if pid else None
        except ChildProcessError:
            ended = None
        if ended is None:
            return status.describe_exit(None)
        return status.describe_exit(ended.si_status if ended.si_code == os.CLD_EXITED else -ended.si_status)

    def _server(self, group: str) -> multiprocessing.forkserver.ForkServer:
        """The group's fork server, made if need be."""
        with self._books:
            if (server := self._servers.get(group)) is None:
                server = self._servers[group] = _GroupServer(self._environment_of(group))
            return server

    def _environment_of(self, group: str) -> dict[str, str]:
        """What the group's fork server reads from os.environ as it starts."""
        return {
            protocol.PRELOAD_ENV: ",".join(self.preload_of(group)),
            protocol.FORKSERVER_GROUP_ENV: group,
            titles.RUNTIME_DIR_ENV: self._runtime_dir,  # for the fork server's title
            # The fork server sets the workers' log level once for all of them: set in
            # each worker, it would copy every logger's page (plumbing/logsetup.py).
            logsetup.LOG_ENV: " ".join(self._log_settings),
        }

    def start_process(self, group: str, process: multiprocessing.process.BaseProcess) -> int:
        """Forks `process` from the group's fork server, starting that first if need be; its pid."""
        # One killed a moment ago looks alive to multiprocessing till it is a zombie: the start would
        # reach its dying socket and fail (EOFError). Started again first, as a reap would have.
        self.revive_if_dead(group, self._identities.get(group))
        server = self._server(group)
        limit = self.fork_limit(group)
        _here.server = server
        try:
            with _killed_if_longer(server, limit, f"the {group} fork server forked no worker"):
                process.start()
        finally:
            _here.server = None
        self._note_pid(group, server)
        self._forked[group] = self._identities.get(group)
        forget(process)
        assert process.pid is not None  # start() returned: the fork server sent the child's pid
        return process.pid

    def fork_limit(self, group: str) -> float:
        """How long a start may wait for the group's fork server: FORK_SECONDS once the one running
        has forked, PRELOAD_SECONDS while it may still import what it preloads."""
        forked = self._forked.get(group)
        if forked is not None and forked == self._identities.get(group) and lifeline.lives(forked):
            return FORK_SECONDS
        return PRELOAD_SECONDS

    def identity_of(self, group: str) -> tuple[int, int] | None:
        """The group's fork server as lifeline.process_identity() names it (None: not started)."""
        return self._identities.get(group)

    def all_running(self) -> bool:
        """Whether every fork server started so far still runs: none died and waits to start again."""
        return all(
            identity is not None and lifeline.lives(identity) for identity in self._identities.values()
        )

    def revive_dead(self) -> None:
        """Reaps and starts again every fork server that died, though no worker of it was reaped to
        tell (it had none)."""
        for group, identity in list(self._identities.items()):
            self.revive_if_dead(group, identity)

    def revive_if_dead(self, group: str, identity: tuple[int, int] | None) -> bool:
        """Whether the group's fork server `identity` has died (its workers die with it). If so,
        it is reaped and another started, as the next start of a worker would do: a zombie till
        then."""
        if identity is None:  # not known: a fork server that died as it started
            return False
        with self._books:
            return self._revive(group, identity)

    def _revive(self, group: str, identity: tuple[int, int]) -> bool:
        if identity in self._dead:
            return True
        if self._identities.get(group) != identity:
            return False
        if not lifeline.is_exiting(identity):
            if lifeline.is_running(identity):
                return False
            # Gone already: a start on the group's own thread found it dead, and multiprocessing
            # reaped it as it started another (_note_pid() tells once that has imported).
            self._dead.add(identity)
            return True
        pid, _ = identity
        try:
            os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # until it is a zombie, not reaping it
        except ChildProcessError:  # reaped already by something else: its pid now names a stranger
            return False
        try:
            server = self._server(group)
            server.ensure_running()  # reaps it and starts another
            self._note_pid(group, server)
        except Exception:
            log.exception("the %s fork server died and could not be started again", group)
        return True

    def stop(self) -> None:
        """Stops and reaps every fork server and the resource tracker.

        All would also exit on their own once this process is gone. The
        resource tracker is never recorded for a later front's purge: it cannot
        carry our title, so a purge could not tell it from a stranger's process,
        and it exits by itself once its pipe's last end closes.
        """
        tracker = getattr(multiprocessing.resource_tracker, "_resource_tracker", None)
        for helper in [*self._servers.values(), tracker]:
            _stop_within(helper, STOP_SECONDS)

    def _note_pid(self, group: str, server: multiprocessing.forkserver.ForkServer) -> None:
        with self._books:
            self._note_pid_held(group, getattr(server, "_forkserver_pid", None))

    def _note_pid_held(self, group: str, pid: int | None) -> None:
        if pid is None:
            log.warning("cannot find the %s fork server's pid: a later front could not purge it", group)
        elif self._pids.get(group) != pid:
            if group in self._pids:
                log.warning("the %s fork server died; multiprocessing started another", group)
                if (dead := self._identities[group]) is not None:
                    self._dead.add(dead)
                self._records.remove(self._pids[group])  # reaped as the other started
            self._pids[group] = pid
            self._identities[group] = lifeline.process_identity(pid)
            log.info("fork server %s (pid %d) imports %s", group, pid, ", ".join(self.preload_of(group)))
            self._records.add(pid)


def _stop_within(helper, seconds: float) -> None:
    """multiprocessing's own stop of a fork server or the resource tracker, which closes the
    helper's pipe and waits for it with no limit; SIGKILL after `seconds`. A fork server exits
    when its pipe closes, unless another process still holds the pipe: a process its worker's
    model started, which inherited it and escaped dying with the worker."""
    stop_helper = getattr(helper, "_stop", None)
    if stop_helper is None:
        return
    pid = getattr(helper, "_forkserver_pid", None) or getattr(helper, "_pid", None)
    identity = lifeline.process_identity(pid) if pid else None  # names it, whatever reuses its pid
    killer = threading.Timer(seconds, _kill_stuck, (identity, seconds)) if identity else None
    if killer is not None:
        killer.start()
    try:
        stop_helper()
    except (OSError, ChildProcessError) as error:
        log.warning("stopping a multiprocessing helper: %s", error)
    finally:
        if killer is not None:
            killer.cancel()
            killer.join()


@contextlib.contextmanager
def _killed_if_longer(server: multiprocessing.forkserver.ForkServer, seconds: float, what: str):
    """SIGKILL to the fork server if the block runs longer than `seconds`. multiprocessing waits
    for a fork server's answer with no limit: a stopped or hung one would hold its start thread,
    every worker start of its group behind it and the front's stop for good; killed, the wait ends (EOFError).
    Its pid is read when the timer fires: a start may have begun by starting it."""

    def kill() -> None:
        pid = getattr(server, "_forkserver_pid", None)
        if pid is not None:  # our child, not yet reaped: the pid is still its own
            log.error("%s within %g s: killing it (pid %d)", what, seconds, pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    timer = threading.Timer(seconds, kill)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()


def _kill_stuck(identity: tuple[int, int], seconds: float) -> None:
    """SIGKILL, if the process `identity` names still runs (its start time tells a reused pid)."""
    pid, _ = identity
    if lifeline.is_running(identity):
        log.warning("multiprocessing helper %d did not stop within %g s: killing it", pid, seconds)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def forget(process: multiprocessing.process.BaseProcess) -> None:
    """Drops a started worker from multiprocessing's own list of children.

    multiprocessing keeps every process it started in a set and polls each
    member (a select() on its sentinel) every time it starts another, so a
    start would cost more with every model loaded. The pool watches and joins
    its workers itself, so the set only slows it down.
    """
    multiprocessing.process._children.discard(process)  # type: ignore[attr-defined]
