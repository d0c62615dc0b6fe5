"""The models one worker holds: one in a worker of its own, several in a pack.

The front decides what goes where; a worker only refuses a second model when
either load did not say `pack` (a worker of its own stays one model's, so its
death is that model's alone). Every call names its model, so a pack looks the
model up per call; a call for a model it does not hold answers NOT_LOADED.

`drop` ends one model of a pack: its close() runs, the processes its load
started are killed (as after a failed load), its objects are freed and the
heap they used goes back to the OS (gc, then malloc_trim), so that the front,
measuring the pack from outside before and after, sees what the model gave
back. A drop in a worker of its own is never sent: the front kills it, with
its whole process group.

A pack loads framework models on a thread of its own at idle priority
(plumbing/priority.py), while its main thread waits for it: every other
process's calls preempt the load. model-mesh loads two models at a time and
calls each as soon as its load returns, so on a busy machine the first call
of one model would otherwise wait for a core behind the other model's load.
The price: the pack's own calls wait for the load, and on a saturated
machine the load takes longer than it did, its end too (the main thread,
woken by the loader's last bytecodes, may preempt it while it still holds
the interpreter lock, and wait for it to get a core back).

Only where the frameworks run each call on the thread that makes it
(WORKER_THREADS=1: a thread pool a load started would inherit the idle
priority for good), and not for custom models, whose constructor may make
what only its own thread may use (formats.pack_loads_at_idle_priority). A
custom model loads on the pack's main thread, which gives way to any other
thread every half millisecond meanwhile (plumbing/yielding.py). A
worker of its own loads on its main thread: its model may take seconds of
CPU to load, which idle priority could stretch past the load timeout on a
saturated machine.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import logging
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from plumbing import heap, lifeline, logsetup, priority, titles, yielding
from plumbing.lifeline import Identity
from plumbing.shmblocks import BlockNotes
from workers import formats, protocol

log = logging.getLogger("mesh.worker")

T = TypeVar("T")


@dataclasses.dataclass
class Held:
    model_id: str
    format: str
    model: Any
    batches_rows: bool  # its format predicts rows independently, and batching is on
    # In a pack: the processes its load started (lifeline.process_identity), ended with its drop.
    helpers: list[Identity] = dataclasses.field(default_factory=list)


class Holdings:
    def __init__(self, batch_max: int, threads: int = 1, blocks: BlockNotes | None = None):
        self.batch_max = batch_max
        self.threads = threads  # WORKER_THREADS
        self.blocks = (
            blocks  # the shared-memory blocks the models make, noted by model (plumbing/shmblocks.py)
        )
        self._idle_loader: concurrent.futures.ThreadPoolExecutor | None = None  # started by a first load
        self.by_id: dict[str, Held] = {}
        self.packed = False  # every load so far said `pack`
        self.batches_rows = False  # some held model batches rows: take every queued message

    def row_wise(self, model_id: str | None) -> bool:
        """Whether the held model a call names predicts rows apart, so its calls may share a predict."""
        held = self.find(model_id)
        return held is not None and held.batches_rows

    def find(self, model_id: str | None) -> Held | None:
        """The held model a call names; a call that names none goes to the one model held."""
        if model_id is None:
            return next(iter(self.by_id.values())) if len(self.by_id) == 1 else None
        return self.by_id.get(model_id)

    def load(self, header: dict, payloads: list) -> list:
        request_id, model_id, packed = header["id"], header["model_id"], bool(header.get("pack"))
        if self.by_id and not (packed and self.packed):
            held = ", ".join(self.by_id)
            message = f"this worker already holds model {held}, and is not a pack"
            return [protocol.error_reply(request_id, protocol.ERROR_LOAD, message)]
        if model_id in self.by_id:
            return [protocol.error_reply(request_id, protocol.ERROR_LOAD, f"{model_id} is loaded already")]
        self.packed = packed
        self._title(extra=model_id)
        started = time.monotonic()
        failure: str | None = None
        try:
            model, helpers, servers = self._load(model_id, header["format"], header["path"])
        except BaseException as error:  # sys.exit() and the like in a constructor fail the load alone
            failure = protocol.described(error)
            # With its traceback, which says where in the model's code: the message alone may not.
            log.warning(
                "load of %s failed: %s", model_id, failure, exc_info=True, extra={"model_id": model_id}
            )
        if failure is not None:  # out of the except block: its traceback holds what the load made
            self._after_change(collect=True)  # what the failed load left goes back before measuring
            self._unlink_blocks_of(model_id)
            self._title()
            return [protocol.error_reply(request_id, protocol.ERROR_LOAD, failure)]
        fmt = formats.by_name(header["format"])
        assert fmt is not None, header["format"]  # formats.load() raised for an unknown format
        batches_rows = fmt.batches_rows and self.batch_max > 1
        self.by_id[model_id] = Held(model_id, fmt.name, model, batches_rows, helpers)
        self._after_change()
        # What the front must know to measure it right: only a worker of its own can (runtime/packs.py).
        running = [list(identity) for identity in [*helpers, *servers] if lifeline.lives(identity)]
        log.info(
            "loaded %s (%s) in %.1f ms",
            model_id,
            fmt.name,
            (time.monotonic() - started) * 1000,
            extra={"model_id": model_id},
        )
        return [protocol.reply(request_id, processes=running) if running else protocol.reply(request_id)]

    def _load(self, model_id: str, format_name: str, path: str) -> tuple[Any, list[Identity], list[Identity]]:
        """The loaded model. In a pack: on the idle loader thread where the format allows it, else
        on this thread, giving way to other threads while a custom model loads (see above). With
        the processes it started, in a pack (_noting_helpers)."""
        fmt = formats.by_name(format_name)
        if not self.packed or fmt is None:
            return self._as_made_by(model_id, formats.load, format_name, path), [], []
        if formats.pack_loads_at_idle_priority(fmt, self.threads):
            if self._idle_loader is None:
                self._idle_loader = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="load", initializer=_become_idle_work
                )
            return self._idle_loader.submit(
                self._as_made_by, model_id, _noting_helpers, format_name, path
            ).result()
        if not fmt.loads_on_any_thread:
            with yielding.giving_way():
                return self._as_made_by(model_id, _noting_helpers, format_name, path)
        return self._as_made_by(model_id, _noting_helpers, format_name, path)

    def _as_made_by(self, model_id: str, load: Callable[[str, str], T], format_name: str, path: str) -> T:
        """load(format_name, path) on this thread, the shared-memory blocks it makes and the log
        records it writes noted as the model's."""
        logsetup.running.model_id = model_id
        if self.blocks is not None:
            self.blocks.made_by(model_id)
        try:
            return load(format_name, path)
        finally:
            logsetup.running.model_id = None
            if self.blocks is not None:
                self.blocks.made_by(None)

    def drop(self, header: dict, payloads: list) -> list:
        model_id = header["model_id"]
        held = self.by_id.pop(model_id, None)
        helpers: list[Identity] = []
        if held is not None:
            try:
                held.model.close()
            except BaseException:
                log.exception("close() of %s raised", model_id, extra={"model_id": model_id})
            helpers = held.helpers
            del held
        self._title()
        # The model's objects go first, and end what they started their own way: a multiprocessing
        # Pool's finalizer waited for ever on the queue lock of a worker killed under it.
        self._after_change(collect=True)
        lifeline.end_children(helpers)  # what is left, with its memory, before the front measures
        self._unlink_blocks_of(model_id)
        log.info("dropped %s; %d models left", model_id, len(self.by_id), extra={"model_id": model_id})
        return [protocol.reply(header["id"])]

    def _unlink_blocks_of(self, model_id: str) -> None:
        """Unlinks the blocks it left, which would keep their memory in /dev/shm after its drop."""
        try:
            unlinked = self.blocks.unlink_blocks_of(model_id) if self.blocks else []
        except Exception:  # the drop goes on: the front unlinks them once the pack is reaped
            log.exception(
                "unlinking the shared-memory blocks %s left failed", model_id, extra={"model_id": model_id}
            )
            return
        for name, size in unlinked:
            log.info(
                "unlinked shared-memory block %s (%.1f MiB) that %s left",
                name,
                size / 2**20,
                model_id,
                extra={"model_id": model_id},
            )

    def close_all(self) -> None:
        """Runs every held model's close(), as the worker exits."""
        for held in self.by_id.values():
            held.model.close()

    def _after_change(self, collect: bool = False) -> None:
        """Gives the heap back to the OS (after freeing what is unreachable, when asked): the front
        measures next. The fork server froze its objects, so a collection walks only ours."""
        self.batches_rows = any(held.batches_rows for held in self.by_id.values())
        if collect:
            gc.collect()
        heap.trim()

    def _title(self, extra: str = "") -> None:
        names = [*self.by_id, extra] if extra else list(self.by_id)
        if not self.packed:
            titles.set_title(f"worker model={names[0]}" if names else "worker")
        else:
            titles.set_title(f"pack models={len(names)}")


def _noting_helpers(format_name: str, path: str) -> tuple[Any, list[Identity], list[Identity]]:
    """A pack's load of a model, the processes this thread started during it (its helpers, for
    its drop to kill: a pack ends only when its last model goes), and the multiprocessing
    servers it started (the pack's from then on). A failed load's helpers are killed at once.
    The thread that loads is the one read: /proc lists a child under the thread that forked it,
    and reading one thread's list costs a tenth of reading every one."""
    before = lifeline.children(of_this_thread=True)
    servers = _multiprocessing_servers()
    try:
        model = formats.load(format_name, path, shared=True)
    except BaseException:
        lifeline.end_children(_started_since(before))
        raise
    started = (lifeline.process_identity(pid) for pid in _multiprocessing_servers() - servers)
    return model, _started_since(before), [identity for identity in started if identity is not None]


def _started_since(before: set[int]) -> list[Identity]:
    new = lifeline.children(of_this_thread=True) - before - _multiprocessing_servers()
    started = (lifeline.process_identity(pid) for pid in new)
    return [identity for identity in started if identity is not None]


def _multiprocessing_servers() -> set[int]:
    """multiprocessing's fork server and resource tracker, if a load of this pack started them: the
    pack's every model uses them once they run (the processes a later model starts that way are
    the fork server's children), so they are no one model's helpers, and end with the pack."""
    servers = set()
    for module, holder, field in (
        ("multiprocessing.forkserver", "_forkserver", "_forkserver_pid"),
        ("multiprocessing.resource_tracker", "_resource_tracker", "_pid"),
    ):
        pid = getattr(getattr(sys.modules.get(module), holder, None), field, None)
        if isinstance(pid, int):
            servers.add(pid)
    return servers


def _become_idle_work() -> None:
    if not priority.schedule_this_thread_as_idle_work():
        log.warning("the kernel refused SCHED_IDLE for the load thread; loads may delay other calls")
