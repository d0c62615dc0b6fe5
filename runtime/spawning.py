"""Starting workers: which fork server forks the next, on which thread, and the pause after failures.

Each fork server starts its workers on a thread of its own, one at a time. A start blocks its
thread until the fork server answers: one started again (after it died) answers only once it has
imported what it preloads (up to forkserver.PRELOAD_SECONDS), a hung one only once it is killed.
On a thread of its own that holds up no other fork server's starts, nor any reap (those run on
the pool's thread). `refill()` decides, in one turn of the event loop, which fork servers start a
worker now, and registers each with the pool in that turn: a start under way counts against
WORKERS_MAX and the OS limits at once, so starts for several fork servers never pass the cap.
Workers of a fork server that do not start pause that fork server alone: 1 s, doubled per
failure in a row, up to 30 s.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import multiprocessing
from typing import TYPE_CHECKING

import workers.main
from runtime.forkserver import ForkServers
from runtime.spares import Spares
from runtime.worker import KillCause, Worker, WorkerState
from runtime.workerconfig import worker_config

if TYPE_CHECKING:
    from runtime.pool import WorkerPool

log = logging.getLogger("mesh.spawning")

SPAWN_TIMEOUT = 30.0  # from the fork to the worker's hello
SPAWN_RETRY_SECONDS = 1.0  # after a failed start; doubled per failure in a row, up to the cap
SPAWN_BACKOFF_CAP_SECONDS = 30.0


class Spawner:
    """The pool's worker starts: `refill()`, or `schedule()` it, whenever spares may be short."""

    def __init__(self, pool: WorkerPool, forkservers: ForkServers, spares: Spares, registered: dict):
        self._pool = pool
        self._forkservers = forkservers
        self._spares = spares
        self._registered: dict[bytes, Worker] = registered  # the pool's workers, by identity
        # Each lives as long as the pool: a fork server it starts dies when it ends (its parent thread).
        self._threads = {
            group: concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"mesh-start-{group}")
            for group in forkservers.groups()
        }
        self.starting: collections.Counter[str] = collections.Counter()  # registered, no hello yet
        self._failures: collections.Counter[str] = collections.Counter()  # in a row, by fork server
        self._paused: dict[str, asyncio.TimerHandle] = {}  # fork servers in their pause, till its end
        self._starts: set[asyncio.Task] = set()
        self._ids = itertools.count(1)
        self._context = multiprocessing.get_context("forkserver")
        self._scheduled = False
        self._closing = False
        self._filled = asyncio.Event()  # nothing short, nothing starting, no fork server paused

    async def fill(self) -> None:
        """Until every fork server has its spares, or the cap holds no more."""
        self.refill()
        await self._filled.wait()

    def schedule(self) -> None:
        """refill() in a later turn: after a caller that asks has joined the line for a spare."""
        if not self._scheduled and not self._closing:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.refill)

    def refill(self) -> None:
        """Starts a worker for each fork server short of spares that is neither starting one nor
        paused, those callers wait for first; at the cap, makes room for the first instead."""
        self._scheduled = False
        while not self._closing:
            group = self._spares.group_short(self.starting, self._busy())
            if group is None:
                break
            if self._pool.at_cap():
                self._pool.make_room_for(group)
                break
            self._begin(group)
        if any(self.starting.values()) or self._paused:
            self._filled.clear()
        else:
            self._filled.set()

    async def close(self) -> None:
        """Starts no other worker, and waits for those under way: cancelled, a start could lose a
        fork (a hung fork server is killed within its limit, runtime/forkserver.py)."""
        self._closing = True
        for timer in self._paused.values():
            timer.cancel()
        self._paused.clear()
        await asyncio.gather(*self._starts, return_exceptions=True)

    def stop_threads(self) -> None:
        """Once the fork servers are stopped: their parent-death signal fires as their thread ends."""
        for thread in self._threads.values():
            thread.shutdown(wait=True)

    def _busy(self) -> frozenset[str]:
        """Fork servers that start no other worker now: one is on its way, or they pause."""
        return frozenset(group for group, count in self.starting.items() if count) | self._paused.keys()

    def _begin(self, group: str) -> None:
        """Registers a worker of `group` with the pool, so that it counts from now on, and starts it."""
        identity = f"w{next(self._ids)}".encode()
        slot = self._pool.beats.allocate()
        channel = self._pool.channel
        config = worker_config(
            self._pool.settings,
            identity,
            (channel.address, channel.lanes_address),
            self._pool.beats.path,
            slot,
        )
        process = self._context.Process(
            target=workers.main.run, args=(config,), name=f"mesh-worker-{identity.decode()}"
        )
        worker = Worker(identity, process, group)
        worker.beat_slot = slot
        self._registered[identity] = worker  # before it starts: its hello may come before we resume
        self.starting[group] += 1
        task = asyncio.create_task(self._start(worker), name=f"start-{identity.decode()}")
        self._starts.add(task)
        task.add_done_callback(self._starts.discard)

    async def _start(self, worker: Worker) -> None:
        group = worker.group
        try:
            started = await self._fork(worker)
        except Exception:
            log.exception("could not start a worker of the %s fork server", group)
            started = False
        finally:
            self.starting[group] -= 1
        self._failures[group] = 0 if started else self._failures[group] + 1
        if self._failures[group] and not self._closing:  # workers that die at start: not forked again at once
            self._pause(group)
        self.refill()

    async def _fork(self, worker: Worker) -> bool:
        """Forks the worker on its fork server's thread; whether it said hello in time."""
        loop = asyncio.get_running_loop()
        try:
            thread = self._threads[worker.group]
            worker.pid, worker.forked_by = await loop.run_in_executor(thread, self._start_process, worker)
        except BaseException:
            self._registered.pop(worker.identity, None)
            assert worker.beat_slot is not None
            self._pool.beats.free(worker.beat_slot)  # its process did not start
            raise
        self._pool.watch_exit(worker)
        await asyncio.wait(
            [worker.ready, worker.exited], timeout=SPAWN_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
        )
        if not worker.ready.done() and worker.alive:
            self._pool.kill(worker, KillCause.NO_HELLO, f"it did not say hello within {SPAWN_TIMEOUT:.0f} s")
        if worker.ready.done() and worker.state is WorkerState.STARTING:
            self._spares.add(worker)
        return worker.ready.done()

    def _start_process(self, worker: Worker) -> tuple[int, tuple[int, int] | None]:
        """On the group's thread: ask its fork server for the child and record it; its pid, and the
        identity of the fork server that forked it."""
        pid = self._forkservers.start_process(worker.group, worker.process)
        self._pool.registry.add(pid)
        return pid, self._forkservers.identity_of(worker.group)

    def _pause(self, group: str) -> None:
        failed = self._failures[group]
        delay = min(SPAWN_BACKOFF_CAP_SECONDS, SPAWN_RETRY_SECONDS * 2 ** (failed - 1))
        log.error(
            "the %s fork server: %d workers in a row did not start; the next in %.0f s", group, failed, delay
        )
        self._spares.note_failed_starts(group, failed)
        self._paused[group] = asyncio.get_running_loop().call_later(delay, self._resume, group)

    def _resume(self, group: str) -> None:
        del self._paused[group]
        self.refill()
