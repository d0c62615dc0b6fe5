"""The pool's idle workers, by fork server, and the callers waiting for one.

Each fork server (runtime/forkserver.py) keeps `warm` spares. A caller that
finds none of its fork server waits in line; a new spare goes to the first
caller in line for its fork server.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars

from plumbing import lifeline
from runtime import status
from runtime.worker import Worker, WorkerState

# Workers of a fork server that failed to start this many times in a row (the pool waits 1 s, then
# 2 s, between them) end the wait of the callers in line for one: a load would otherwise wait for
# LOADTIME_TIMEOUT and fail as a load that ran too long, a heal for ever.
FAILED_STARTS_BEFORE_GIVING_UP = 3

# What the current task (a load) waits for before it can start: a spare of a fork server, set here
# and left set if it gives up waiting (a load that timed out then says that it never started).
waiting_for: contextvars.ContextVar[str | None] = contextvars.ContextVar("waiting_for", default=None)


class Spares:
    def __init__(self, warm: int, groups: tuple[str, ...]):
        self.warm = warm
        self._idle: dict[str, collections.deque[Worker]] = {group: collections.deque() for group in groups}
        self._waiters: collections.deque[tuple[str, asyncio.Future]] = collections.deque()

    def pop(self, group: str) -> Worker | None:
        """An idle spare of the fork server `group`, now the caller's."""
        idle = self._idle[group]
        while idle:
            worker = idle.popleft()
            if worker.state is WorkerState.SPARE and not _dead(worker):  # nor killed since it was added
                return worker
        return None

    def add(self, worker: Worker) -> None:
        """A worker that said hello: idle, and handed to the first caller in line for its fork server."""
        worker.change_state(WorkerState.SPARE)
        self._idle[worker.group].append(worker)
        self._wake_a_waiter(worker.group)

    def discard(self, worker: Worker) -> None:
        idle = self._idle.get(worker.group)
        if idle is not None and worker in idle:
            idle.remove(worker)

    async def wait(self, group: str) -> None:
        """Until a spare of `group` may be there (pop() again: another caller may have been faster)."""
        entry = (group, asyncio.get_running_loop().create_future())
        self._waiters.append(entry)
        waiting_for.set(f"a worker of the {group} fork server")
        try:
            await entry[1]
        except BaseException:
            # We gave up: a spare meant for us goes to the next in line.
            self._waiters.remove(entry)
            self._wake_a_waiter(group)
            raise
        self._waiters.remove(entry)
        waiting_for.set(None)

    def note_failed_starts(self, group: str, failures: int) -> None:
        """`failures` workers of `group` in a row did not start: past the limit, every caller in
        line for one gets UNAVAILABLE."""
        if failures >= FAILED_STARTS_BEFORE_GIVING_UP:
            self.fail_waiters(group, status.workers_do_not_start(group, failures))

    def fail_waiters(self, group: str, error: Exception, served: int = 0) -> None:
        """Every caller in line for a spare of `group` gets `error`, but the first `served` (as many
        as workers on their way will serve) and as many as there are idle spares of `group`."""
        keep = served + len(self._idle.get(group, ()))
        for wanted, waiter in self._waiters:
            if wanted != group:
                continue
            if keep > 0:
                keep -= 1
            elif not waiter.done():
                waiter.set_exception(error)

    def alive(self) -> list[Worker]:
        return [worker for idle in self._idle.values() for worker in idle if worker.alive]

    def of_another(self, group: str) -> Worker | None:
        """An idle spare of any fork server but `group`."""
        for other, idle in self._idle.items():
            for worker in idle:
                if other != group and worker.state is WorkerState.SPARE:
                    return worker
        return None

    def group_short(
        self, starting: collections.Counter[str], skip: frozenset[str] = frozenset()
    ) -> str | None:
        """A fork server to fork a spare from next, but those in `skip`: first those callers wait
        for, in their order, then any with fewer than `warm` ready or `starting`; None when all
        are covered. No spare is kept warm while callers of a fork server in `skip` are short of
        one: it could take the last room under the cap that they need."""

        def short(group: str, wanted: int) -> bool:
            return len(self._idle.get(group, ())) + starting[group] < wanted

        waited_for = [group for group, _ in self._waiters if short(group, self.waiting(group))]
        if waited_for:
            return next((group for group in waited_for if group not in skip), None)
        for group in self._idle:
            if group not in skip and short(group, self.warm + self.waiting(group)):
                return group
        return None

    def all_warm(self) -> bool:
        """Whether every fork server has its `warm` spares ready, their processes living (not killed
        a moment ago, before their reap removes them), and nobody waits for one."""
        if self._waiters:
            return False
        return all(sum(map(_lives, idle)) >= self.warm for idle in self._idle.values())

    def waiting(self, group: str) -> int:
        """Callers in line for a spare of `group`."""
        return sum(1 for wanted, _ in self._waiters if wanted == group)

    def _wake_a_waiter(self, group: str) -> None:
        if not self._idle.get(group):
            return
        for wanted, waiter in self._waiters:
            if wanted == group and not waiter.done():
                waiter.set_result(None)
                return


def _dead(worker: Worker) -> bool:
    """Whether the worker has died or begun to, though its reap has not come yet (its exit goes
    through the fork server and the pool's reaping thread): a load sent to it would fail as its own."""
    identity = worker.pid_identity
    return identity is not None and not lifeline.lives(identity)


def _lives(worker: Worker) -> bool:
    identity = worker.pid_identity
    return worker.state is WorkerState.SPARE and identity is not None and lifeline.lives(identity)
