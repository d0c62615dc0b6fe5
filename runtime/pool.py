"""Worker processes: the fork servers, warm spares, killing and reaping.

The pool is the only owner of the worker socket (runtime/channel.py) and the only place that changes a
worker's state or kills one (`kill()`, with a KillCause that also names the metric label). What the rest of
the front needs from workers it asks here: `take()` a spare, `send_load()`, `submit_call()`, `kill()`.

Every worker is forked by one of multiprocessing's fork servers, one per framework family and a base one
(runtime/forkserver.py), which imported numpy, those frameworks and the worker code once (workers/preload.py),
so a new worker starts in milliseconds with a few MiB of its own memory. Each fork server keeps WORKERS_WARM
idle spares connected (runtime/spares.py): `take()` hands out one of the model's fork server, a background
refill forks the next (runtime/spawning.py, a thread per fork server). The pool owns the beat file
(runtime/beats.py): a slot per worker, till reaped. The pool's own thread runs what blocks beside the starts:
reaps, and the fork servers' start and stop.

A worker's death is seen at once, never by polling: the event loop watches its process sentinel (a pipe the
fork server writes the exit code to once it has reaped the child). `Worker.exited` resolves only then, so
"await the kill" means "the memory is back in the OS".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import time

from runtime import filelimit, forkserver, heartbeat, oomkills, status, tasklimit
from runtime.beats import BeatFile
from runtime.channel import Channel, PeerGone
from runtime.heaptrim import QuietTrimmer
from runtime.leftovers import ProcessRegistry
from runtime.settings import Settings
from runtime.spares import Spares
from runtime.spawning import Spawner
from runtime.worker import KillCause, Worker, WorkerState
from workers import protocol

log = logging.getLogger("mesh.pool")


class WorkerPool:
    def __init__(self, settings: Settings, on_worker_exit):
        self.settings = settings
        self.registry = ProcessRegistry(settings.runtime_dir)
        self.channel = Channel(
            f"ipc://{settings.runtime_dir}/workers.sock",
            self._on_event,
            busy_poll_seconds=settings.busy_poll_us / 1e6,
            ring_bytes=settings.shared_ring_bytes,
            runs_at_once=settings.worker_threads,
            lanes_path=f"{settings.runtime_dir}/lanes.sock",
            pid_of=self._pid_of,
        )
        self.beats = BeatFile(settings.runtime_dir)
        self.ready = False
        self._on_worker_exit = on_worker_exit
        # Reaps, and the fork servers' start and stop: it must live as long as the fork servers it starts.
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mesh-reaper")
        log_settings = (settings.log_level, settings.log_format)
        self._forkservers = forkserver.ForkServers(
            settings.worker_preload, settings.runtime_dir, log_settings, records=self.registry
        )
        self._workers: dict[bytes, Worker] = {}
        self._spares = Spares(settings.workers_warm, self._forkservers.groups())
        self._spawner = Spawner(self, self._forkservers, self._spares, self._workers)
        self._tasks: set[asyncio.Task] = set()
        self._heartbeat: asyncio.Task | None = None
        self.heap = QuietTrimmer()  # note() whenever the front freed what it held for something
        self._closing = False
        self._oom_kills = oomkills.OomKills()

    # -- start and stop -------------------------------------------------------

    async def start(self) -> None:
        """Kills what an earlier front left, starts the fork servers, fills the spares."""
        purged = await asyncio.to_thread(self.registry.purge)
        if purged:
            log.warning("purged %d processes left by an earlier runtime: %s", len(purged), purged)
        self.channel.start()
        await asyncio.get_running_loop().run_in_executor(self._thread, self._forkservers.start_all)
        self.registry.record_temp_folder()  # multiprocessing made it for their sockets
        silence_limit = self.settings.worker_heartbeat_timeout_ms / 1000
        self._heartbeat = self._background(heartbeat.watch_forever(self, silence_limit), "heartbeat")
        # A stop before the spares are ready cancels only this wait; close() awaits the starts.
        await self._spawner.fill()
        self.ready = True
        log.info("worker pool ready: %d warm spares", len(self.spares()))

    async def close(self) -> list[Worker]:
        """Kills every worker, waits until each is reaped, stops the fork servers; those not seen to exit."""
        self._closing = True
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        await self._spawner.close()
        workers = list(self._workers.values())
        for worker in workers:
            self.kill(worker, KillCause.SHUTDOWN, "the front is stopping")
        if workers:
            await asyncio.wait([w.exited for w in workers], timeout=10)
        self.heap.cancel()  # the front is about to exit: that gives everything back
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._thread, self._forkservers.stop)
        # A hung fork server's workers are reaped only once it is gone: it writes their exits.
        if unreaped := [w for w in workers if not w.exited.done()]:
            await asyncio.wait([w.exited for w in unreaped], timeout=forkserver.STOP_SECONDS)
        for worker in (unreaped := [w for w in workers if not w.exited.done()]):
            loop.remove_reader(worker.process.sentinel)  # a reap now would find the beat file closed
        self._spawner.stop_threads()
        self._thread.shutdown(wait=True)
        await self.channel.close()
        self.beats.close()
        return unreaped

    # -- handing out workers --------------------------------------------------

    async def take(self, format_name: str) -> Worker:
        """A connected idle worker for a model of `format_name`, the caller's (to kill in the end)."""
        group = forkserver.group_for(format_name, self.settings.worker_preload)
        while (worker := self._spares.pop(group)) is None:
            if self.at_cap() and self._spawner.starting[group] == 0 and not self._spares_elsewhere(group):
                raise status.out_of_workers(self.settings.workers_max, self._os_limit_reached())
            self._spawner.schedule()  # at the cap, it makes room (make_room_for)
            await self._spares.wait(group)
        # No refill yet: on two cores a fork now would slow the load this worker is for (see replenish()).
        return worker

    def replenish(self) -> None:
        """Forks spares in the background until WORKERS_WARM are ready again."""
        self._spawner.schedule()

    # -- what workers are asked to do -------------------------------------------

    async def send_load(
        self, worker: Worker, model_id: str, format_name: str, path: str, pack: bool = False
    ) -> dict:
        """Has a taken spare, or a serving pack, load a model; the reply header (PeerGone if it dies)."""
        packing = pack and worker.packed and worker.state is WorkerState.SERVING
        if worker.state is not WorkerState.SPARE and not packing:  # died or was killed since taken
            raise PeerGone(worker.exit_code(), worker.death_cause)
        worker.packed = pack
        worker.models.add(model_id)
        if not packing:
            worker.change_state(WorkerState.LOADING)
        reply = await self._pack_operation(
            worker, protocol.OP_LOAD, model_id=model_id, format=format_name, path=path, pack=pack
        )
        if reply["ok"] and worker.state is WorkerState.LOADING:  # not killed meanwhile
            worker.change_state(WorkerState.SERVING)
        return reply

    async def send_drop(self, worker: Worker, model_id: str) -> dict:
        """Has a pack end one of its models; the reply header. Raises PeerGone if it dies first."""
        assert worker.packed, worker  # a worker of its own is killed instead
        worker.models.discard(model_id)
        return await self._pack_operation(worker, protocol.OP_DROP, model_id=model_id)

    async def _pack_operation(self, worker: Worker, op: str, **fields) -> dict:
        # Its one thread is busy, so it is not hung (runtime/heartbeat.py), until it answers or dies,
        # whether or not its caller still waits: a load given up on still runs in the pack.
        worker.pack_operations += 1
        reply, _ = await self.channel.submit(worker.identity, op, on_end=worker.end_pack_operation, **fields)
        return reply

    def submit_call(
        self,
        worker: Worker,
        model_id: str,
        method: str,
        request: bytes,
        deadline: float | None,
        unanswered: int,
        on_end,
        overdue_after: float | None,
        on_overdue,
    ) -> asyncio.Future:
        """Sends one call (header fields: workers/protocol.py) with Channel.submit(), which says what
        `on_end` and `on_overdue` do; resolves to (reply header, payload frames) or raises PeerGone."""
        return self.channel.submit(
            worker.identity,
            protocol.OP_CALL,
            [request],
            on_end=on_end,
            overdue_after=overdue_after,
            on_overdue=on_overdue,
            model=model_id,
            method=method,
            deadline=deadline,
            unanswered=unanswered,
        )

    def kill(self, worker: Worker, cause: KillCause, reason: str, grace: float = 0.0) -> None:
        """Ends a worker, remembering why: the one place the front decides that a worker must go.

        With a grace, SIGTERM first (a model's close() runs), SIGKILL after it. The exit handling,
        status codes and metrics read the cause. Killing a condemned worker again only hurries it.
        """
        if worker.state is WorkerState.EXITED:
            return
        if worker.state is not WorkerState.CONDEMNED:
            worker.kill_cause, worker.kill_reason = cause, reason
            worker.change_state(WorkerState.CONDEMNED)
            extra = {"model_id": worker.model_id} if worker.model_id else None
            level = logging.DEBUG if cause.expected else logging.WARNING
            log.log(level, "killing %r: %s", worker, reason, extra=extra)
            if grace > 0:
                worker.signal(signal.SIGTERM)
                asyncio.get_running_loop().call_later(grace, worker.kill_now)
                return
        worker.kill_now()

    def workers(self) -> list[Worker]:
        return list(self._workers.values())

    def last_beat(self, worker: Worker) -> float:
        """The time.monotonic() of the worker's last stamp in the beat file (runtime/heartbeat.py)."""
        return self.beats.last_beat(worker.beat_slot) if worker.beat_slot is not None else 0.0

    def spares(self) -> list[Worker]:
        return self._spares.alive()

    def settled(self) -> bool:
        """Every fork server runs, and has its warm spares or all the cap allows: what the capacity
        counts now is what stays."""
        spares = self._spares.all_warm() or (self.at_cap() and not any(self._spawner.starting.values()))
        return self.ready and self._forkservers.all_running() and spares

    def revive_forkservers(self) -> None:
        """Has the pool's thread reap, and start again, a fork server that died with no worker of
        its own to tell (each worker's reap looks at its fork server)."""
        if not self._closing:
            self._thread.submit(self._forkservers.revive_dead)

    # -- room for workers ---------------------------------------------------------

    def at_cap(self) -> bool:
        """No other worker may start: WORKERS_MAX of them run or start, or an OS limit holds no more."""
        cap = self.settings.workers_max
        return (cap > 0 and len(self._workers) >= cap) or self._os_limit_reached() is not None

    def _os_limit_reached(self) -> str | None:
        """The OS limit that holds no other worker ("open-file", "task"), or None. Workers on their
        way may not have opened their files or started their threads yet: they count as if they had."""
        starting = sum(self._spawner.starting.values())
        if not filelimit.room_for_a_worker(len(self._workers), starting):
            return "open-file"
        return None if tasklimit.room_for_a_worker(starting=starting) else "task"

    def _spares_elsewhere(self, group: str) -> bool:
        """Spares of other fork servers, idle or starting: at the cap, room for one of `group`."""
        starting = any(count for other, count in self._spawner.starting.items() if other != group)
        return starting or self._spares.of_another(group) is not None

    def make_room_for(self, group: str) -> None:
        """At the cap, with callers waiting for one of `group`: ends an idle spare of another group."""
        other = self._spares.of_another(group) if self._spares.waiting(group) else None
        if other is None:  # refused as take() refuses them: no reap may come to end their wait
            error = status.out_of_workers(self.settings.workers_max, self._os_limit_reached())
            return self._spares.fail_waiters(group, error, served=self._spawner.starting[group])
        self.kill(other, KillCause.SURPLUS, f"room for a worker of the {group} fork server")

    def watch_exit(self, worker: Worker) -> None:
        """Reaps the worker started now as soon as it exits (its process sentinel)."""
        asyncio.get_running_loop().add_reader(worker.process.sentinel, self._on_sentinel, worker)

    # -- events from workers and the OS ---------------------------------------

    def _on_event(self, identity: bytes, header: dict) -> None:
        worker = self._workers.get(identity)
        if worker is None:
            log.warning("message %r from unknown worker %r", header["op"], identity)
            return
        worker.last_seen = time.monotonic()
        if header["op"] == protocol.OP_HELLO and not worker.ready.done():
            worker.ready.set_result(None)

    def _pid_of(self, identity: bytes) -> int | None:
        worker = self._workers.get(identity)
        return None if worker is None else worker.pid

    def _on_sentinel(self, worker: Worker) -> None:
        asyncio.get_running_loop().remove_reader(worker.process.sentinel)
        self._background(self._reap(worker), f"reap-{worker.identity.decode()}")

    async def _reap(self, worker: Worker) -> None:
        loop = asyncio.get_running_loop()
        code = await loop.run_in_executor(self._thread, self._collect_exit, worker)
        self._workers.pop(worker.identity, None)
        if all(other.pid != worker.pid for other in self._workers.values()):  # its pid is no new worker's
            worker.end_what_it_started()
        if worker.beat_slot is not None:
            worker.last_running = self.beats.running(worker.beat_slot)
            self.beats.free(worker.beat_slot)  # reaped: nothing stamps it any more
        self._spares.discard(worker)
        # Exited first: failing its requests frees their replica slots at once,
        # and a dead worker must not look like the least busy one to a caller in line.
        worker.change_state(WorkerState.EXITED)
        worker.exited.set_result(code)
        worker.running = frozenset(model_id for model_id, calls in worker.calls.items() if calls > 0)
        self.channel.fail_peer(worker.identity, code, worker.death_cause)
        extra = {"model_id": worker.model_id} if worker.model_id else None
        log.info("%r exited (%s)", worker, worker.death_cause or status.describe_exit(code), extra=extra)
        self._on_worker_exit(worker, code)
        self.heap.note()  # what the front held for the worker is free now
        self._spawner.schedule()

    def _collect_exit(self, worker: Worker) -> int | None:
        """The pool's thread: read the exit code the fork server wrote, free the process object, note
        whether the worker died with its fork server (which is then started again) or for memory."""
        worker.orphaned = not self._closing and self._forkservers.revive_if_dead(
            worker.group, worker.forked_by
        )
        process, pid = worker.process, worker.pid
        assert pid is not None  # watched (watch_exit) only once the pid is set
        process.join(timeout=5)
        code = process.exitcode
        worker.oom_killed = self._oom_kills.claim(code == -signal.SIGKILL and worker.kill_cause is None)
        if code is not None:
            process.close()
        self.registry.remove(pid, worker.pid_identity)
        return code

    def _background(self, coroutine, name: str) -> asyncio.Task:
        task = asyncio.create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
