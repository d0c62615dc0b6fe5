"""One worker process as the front sees it: its state, and why the front ended it if it did.

A worker's life, each step made by exactly one place in the pool:

    STARTING ──hello──► SPARE ──load sent──► LOADING ──load done──► SERVING
        │                 │                    │                      │
        └────────── killed by the front (WorkerPool.kill) ────────────┴──► CONDEMNED
    any state ──reaped (its process sentinel fired)──► EXITED

`change_state()` refuses any other move, so a bug in the bookkeeping fails
loudly where it happens instead of sending a call to a dying worker. A
worker that dies on its own goes straight to EXITED; one the front killed
passes through CONDEMNED, which takes no more calls.

A pack (runtime/packs.py) is a worker that holds several small models: it
takes further loads, and drops, while SERVING the models it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import multiprocessing
import os
import signal
import time
from collections.abc import Callable

from plumbing import lifeline, priority
from runtime.forkserver import BASE_GROUP
from workers import protocol

# How often calls_answered() looks: an unload waits for it.
CALLS_CHECK_SECONDS = 0.001
# How long a pack being ended may take to answer the calls already sent to it.
DRAIN_SECONDS = 10.0


class WorkerState(enum.Enum):
    STARTING = "starting"  # forked, has not said hello
    SPARE = "spare"  # connected and idle, no model yet
    LOADING = "loading"  # a load was sent; its main thread cannot beat
    SERVING = "serving"  # holds its model and takes calls
    CONDEMNED = "condemned"  # the front killed it; not reaped yet
    EXITED = "exited"  # reaped: its memory is back in the OS


_MOVES = {
    WorkerState.STARTING: {WorkerState.SPARE, WorkerState.CONDEMNED, WorkerState.EXITED},
    WorkerState.SPARE: {WorkerState.LOADING, WorkerState.CONDEMNED, WorkerState.EXITED},
    WorkerState.LOADING: {WorkerState.SERVING, WorkerState.CONDEMNED, WorkerState.EXITED},
    WorkerState.SERVING: {WorkerState.CONDEMNED, WorkerState.EXITED},
    WorkerState.CONDEMNED: {WorkerState.EXITED},
    WorkerState.EXITED: set(),
}


class KillCause(enum.Enum):
    """Why the front ended a worker. The value is the `cause` label of mesh_worker_restarts_total."""

    HUNG = "hung"  # its loop stopped beating while idle
    MEMORY = "memory"  # over WORKER_MEMORY_LIMIT_BYTES
    REQUEST_TIMEOUT = "request_timeout"  # a call ran past WORKER_REQUEST_TIMEOUT_MS
    OPERATOR = "operator"  # the admin kill command
    RELOAD_FAILED = "reload_failed"  # a heal's reload did not succeed
    NO_HELLO = "no_hello"  # never connected after it was forked
    UNLOAD = "unload"  # its model is unloaded, or its load failed
    SHUTDOWN = "shutdown"  # the front is stopping
    SURPLUS = "surplus"  # an idle spare ended at WORKERS_MAX to make room for one of another fork server
    RECYCLED = "recycled"  # a pack whose models moved to a fresh one (runtime/packs.py)

    @property
    def expected(self) -> bool:
        """Part of normal operation, not a fault: logged quietly."""
        return self in (KillCause.UNLOAD, KillCause.SHUTDOWN, KillCause.SURPLUS, KillCause.RECYCLED)


# The label of a worker that died without the front killing it.
CRASH_LABEL = "crash"
# The label of one that died with its fork server.
ORPHANED_LABEL = "forkserver"
# Its cause of death, said instead of its exit code: multiprocessing's for "the fork server did not say".
FORKSERVER_DIED = "its fork server died"
# ... and for one killed by a SIGKILL the front did not send while the kernel counted an OOM kill.
OUT_OF_MEMORY = "killed by SIGKILL as the kernel's OOM killer ran: out of memory"


class IllegalTransition(RuntimeError):
    """A state change the worker's life does not allow: a bug in the front."""


class Worker:
    def __init__(
        self, identity: bytes, process: multiprocessing.process.BaseProcess, group: str = BASE_GROUP
    ):
        loop = asyncio.get_running_loop()
        self.identity = identity
        self.process = process
        self.group = group  # the fork server it was forked from (runtime/forkserver.py)
        self.forked_by: tuple[int, int] | None = (
            None  # that fork server, as lifeline.process_identity() names it
        )
        self._pid: int | None = None
        self.pid_identity: tuple[int, int] | None = None  # (pid, start time): lifeline.is_running()
        self.state = WorkerState.STARTING
        self.models: set[str] = set()  # ids of the models it holds or is loading
        self.packed = False  # a pack: it may hold several models
        self.pack_operations = 0  # loads and drops a pack runs while SERVING; its thread cannot beat
        self.started = time.monotonic()
        self.in_flight = 0  # calls sent and not answered yet
        self.calls: dict[str, int] = {}  # of those, per model id (none: absent)
        self.moved_out: set[str] = set()  # models whose calls went to another pack while it served them
        self.running: frozenset[str] = frozenset()  # models with calls in it when it died
        # What its main thread ran when it died: a model_tag() or NOTHING_RUNNING (packs only).
        self.last_running = protocol.NOTHING_RUNNING
        self.kill_cause: KillCause | None = None
        # Its fork server had died when it was reaped: its death is not its model's doing.
        self.orphaned = False
        self.oom_killed = False  # set once reaped (runtime/oomkills.py)
        self.kill_reason = ""  # the sentence for logs and status messages
        self.served = 0
        self.errors = 0
        self.last_error = ""
        self.last_seen = self.started  # its last message; its beats are in the beat file
        self.beat_slot: int | None = None  # its slot in the beat file (runtime/beats.py)
        self.ready = loop.create_future()  # resolves on the worker's hello
        self.exited = loop.create_future()  # resolves to the exit code once reaped

    def change_state(self, new: WorkerState) -> None:
        if new not in _MOVES[self.state]:
            raise IllegalTransition(
                f"{self!r}: {self.state.value} -> {new.value} is not a move a worker makes"
            )
        self.state = new

    @property
    def model_id(self) -> str | None:
        """The model of a worker of its own; None for a spare or a pack."""
        if self.packed or len(self.models) != 1:
            return None
        return next(iter(self.models))

    @model_id.setter
    def model_id(self, model_id: str) -> None:
        self.models = {model_id}

    def end_pack_operation(self) -> None:
        self.pack_operations -= 1

    @property
    def alive(self) -> bool:
        return self.state is not WorkerState.EXITED

    @property
    def serving(self) -> bool:
        """Holds its model and takes calls: not loading, not killed, not gone."""
        return self.state is WorkerState.SERVING

    @property
    def busy(self) -> bool:
        """Its one thread may be running a load or a call, so a missed beat proves nothing."""
        return self.state is WorkerState.LOADING or self.in_flight > 0 or self.pack_operations > 0

    @property
    def death_label(self) -> str:
        """The metric label of its death: why the front killed it, "forkserver" or "crash"."""
        if self.kill_cause:
            return self.kill_cause.value
        return ORPHANED_LABEL if self.orphaned else CRASH_LABEL

    @property
    def death_cause(self) -> str:
        """Why it died where the front knows better than its exit code; "" where it does not."""
        if self.orphaned:
            return FORKSERVER_DIED
        return OUT_OF_MEMORY if self.oom_killed else ""

    async def reaped_within(self, seconds: float) -> None:
        """Returns once it is reaped (its exit code and cause known), or `seconds` passed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(self.exited), seconds)

    def exit_code(self) -> int | None:
        """Its exit code once reaped; None before, or when it could not be read."""
        return self.exited.result() if self.exited.done() else None

    def signal(self, signum: int, whole_group: bool = False) -> None:
        """Sends a signal if the process may still be there; only the pool calls this. With
        `whole_group`, to its process group: the worker, and what its model started
        (workers/main.py), if the worker is still the process it was."""
        if self.pid is None or not self.alive:
            return
        identity = self.pid_identity
        if identity and not lifeline.is_running(identity):
            return  # already dead (the sentinel will tell), its pid perhaps another process's now
        try:
            if whole_group:
                try:
                    os.killpg(self.pid, signum)
                    return
                except ProcessLookupError:
                    pass  # no such group yet: signalled before it made its own
            os.kill(self.pid, signum)
        except ProcessLookupError:
            pass  # already dead; the sentinel will tell

    @property
    def pid(self) -> int | None:
        return self._pid

    @pid.setter
    def pid(self, pid: int | None) -> None:
        """Set once the process runs: its start time is noted with it, so that a pid the kernel
        gave to another process after this one was reaped is never taken for it."""
        self._pid = pid
        self.pid_identity = lifeline.process_identity(pid) if pid is not None else None

    def end_what_it_started(self) -> None:
        """Once reaped: SIGKILL to what is left of its process group, what its model started (if it
        died of a crash or the OOM killer, say). While the group has a member its number is no
        other process's; with none left, no group has it unless a new process took the pid."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)

    def kill_now(self) -> None:
        """SIGKILL; only the pool calls this. A recycled pack is made idle work first: the kernel
        tears its memory down in its own context, which then waits for the calls of the pack its
        models moved to. Not other workers: a kill for memory wants it back at once, and healing
        or a spare's place wait for the reap."""
        identity = self.pid_identity
        if identity and lifeline.is_running(identity):
            if self.kill_cause is KillCause.RECYCLED:
                priority.schedule_process_as_idle_work(identity[0])
            # What its model started and that left its process group (setsid): no group kill reaches it.
            lifeline.kill_descendants(identity[0])
        self.signal(signal.SIGKILL, whole_group=True)

    def __repr__(self) -> str:
        if self.packed:
            return f"<pack {self.identity.decode()} pid={self.pid} models={len(self.models)}>"
        return f"<worker {self.identity.decode()} pid={self.pid} model={self.model_id}>"


async def calls_answered(worker: Worker, model_id: str, within: float) -> bool:
    """Whether the worker answers every call of the model it was sent (or dies) within `within` s."""
    deadline = time.monotonic() + within
    while worker.calls.get(model_id) and worker.alive:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(CALLS_CHECK_SECONDS)
    return True


async def drain(worker: Worker, owing: Callable[[], bool] | None = None) -> None:
    """Waits while the worker owes a reply (`owing()`, if given: say, only those of some models'
    calls it has begun), or until DRAIN_SECONDS passed."""
    deadline = time.monotonic() + DRAIN_SECONDS
    while worker.serving and time.monotonic() < deadline:
        if not (owing() if owing is not None else worker.in_flight):
            return
        await asyncio.sleep(CALLS_CHECK_SECONDS)
