"""One pack's records: the worker, the models placed in it, what each is charged, its state.

What goes into a pack, and how its loads and drops are measured, is
runtime/packs.py; moves between packs are runtime/repacking.py, which of its models move
with it is here.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from plumbing.lifeline import Identity
from runtime.model import Model, ModelState
from runtime.worker import Worker

# How long a model just loaded is taken to wait for its first call, when none comes.
FIRST_CALL_WAIT_SECONDS = 1.0
# What a pack's drops may fail to give back in all before it is recycled: heap pages that stay
# partly used by the survivors, allocator bookkeeping.
RECYCLE_SLACK_BYTES = 128 * 1024
# The states of a model whose place in a pack moves with the pack's other models.
MOVING_STATES = (ModelState.READY, ModelState.LOADING)


class Pack:
    def __init__(self, worker: Worker, format_name: str):
        self.worker = worker
        self.format_name = format_name  # a pack holds models of one format
        self.members: dict[str, Model] = {}  # placed here: loading or loaded
        self.charged: dict[str, int] = {}  # loaded: model id -> its reported size
        self.growth_charged: dict[str, int] = {}  # loaded: model id -> the part of its size not base
        self.grown: dict[str, int] = {}  # loaded: model id -> what its load added, measured
        # loaded: model id -> the processes its load left running below the pack, if any
        self.started: dict[str, set[Identity]] = {}
        self.lock = asyncio.Lock()  # one load or drop at a time: each is measured before and after
        self.open = True  # takes new models; False once it is recycled, emptied, dead or left to a load
        self.abandoned = ""  # the model whose load was given up while the pack may still run it
        self.left_to: Model | None = None  # its others moved out while this one's load ran long
        self.left_behind: set[str] = set()  # ids of models that moved out, still held until that load is in
        self.left = asyncio.Event()  # set once it is left to that load
        self.base_bytes = 0  # what it cost once it rehearsed its first load, its share of the front included
        self.calls_bytes = 0  # charged with the base: its format's first calls of a worker
        self.last_loaded: Model | None = None  # the model of its last load, and when that load returned
        self.last_loaded_at = 0.0
        self.left_over = 0  # what its drops and failed loads did not give back, in all

    def note_left_over(self, kept: int) -> int:
        """Adds what a drop or a failed load kept (less than 0: it gave back more, heap an earlier
        one kept) to what the pack's drops kept in all, which it returns: each may be under the
        slack, while thousands of them in the pack's life add up to any size. Not floored at 0: a
        page measured one way or the other would then only ever add up. Floored at minus the
        slack: a drop also gives back what the model's calls allocated after its load was
        measured (a cache built on its first call), and that credit, unbounded, would hide the
        leftovers of any number of later drops."""
        self.left_over = max(self.left_over + kept, -RECYCLE_SLACK_BYTES)
        return self.left_over

    def give_up_load(self, model_id: str) -> None:
        """The model's load was given up on while the pack may still run it: no other load goes
        there meanwhile (it would wait that load out), and the next unload from it recycles the pack."""
        self.abandoned = model_id
        self.open = False

    def preference(self, now: float) -> tuple[bool, bool, int]:
        """Packs that take a model sort by this: free of loads, then of first calls due, then fullest."""
        return (not self.lock.locked(), not self.awaits_first_call(now), len(self.members))

    def awaits_first_call(self, now: float) -> bool:
        """Its last model is just loaded and yet to be called: a load sent now would delay that call."""
        last = self.last_loaded
        return last is not None and not last.called and now - self.last_loaded_at < FIRST_CALL_WAIT_SECONDS


class PackedLoad(NamedTuple):
    worker: Worker  # the pack's
    reply: dict  # the pack's reply to the load
    size: int  # what the model is charged there; 0 if the load failed
    # Its load left processes running below the pack: the pages it shares with them, and those of
    # its neighbours a forked child keeps, are in no measure of the pack (runtime/supervisor.py
    # moves such a model to a worker of its own, measured as a tree there).
    started_processes: bool


def switch(model: Model, old: Worker, new: Worker) -> None:
    """The model's calls go to `new` from now on; those sent to `old` finish there (if it lives)."""
    if model.state is ModelState.LOADING:  # its other replicas still load: none takes calls yet
        if old in model.workers:
            model.workers[model.workers.index(old)] = new
        return
    if old in model.workers:
        model.workers.remove(old)
        old.moved_out.add(model.model_id)  # a call it never begins goes to `new` if it dies
    model.workers.append(new)
    model.replicas.add(new)
    model.replicas.remove(old)


def moves_with(pack: Pack, model: Model) -> bool:
    """Whether a member of `pack` moves when it is recycled or compacted: one loaded there, whether
    the model is ready or still loads its other replicas (left behind, it would go with the pack)."""
    return model.model_id in pack.charged and pack.worker in model.workers and model.state in MOVING_STATES
