"""Which pack a packed model goes into (runtime/packs.py Packs._place), with stand-in packs."""

from __future__ import annotations

import asyncio
import time

from standins import StandInPool, StandInWorker, holding, ready_model

from runtime import packs
from runtime.settings import Settings
from runtime.worker import WorkerState


def placed(last_called: bool) -> str:
    """The pack a new model goes into, of two with room: A holds two models, the last just loaded
    (called once if `last_called`), B holds one."""

    async def scenario():
        pack_set = packs.Packs(Settings.from_env({"MODELS_PER_WORKER": "4"}), StandInPool())
        fuller, emptier = (pack_set.new_pack(StandInWorker(name), "python") for name in ("A", "B"))
        last = ready_model("last")
        last.called = last_called
        holding(fuller, ready_model("first"), last)
        fuller.last_loaded, fuller.last_loaded_at = last, time.monotonic()
        holding(emptier, ready_model("other"))
        return (await pack_set._place(ready_model("new"), avoid=[])).worker.name

    return asyncio.run(scenario())


def test_a_model_goes_into_the_fullest_pack_with_room():
    assert placed(last_called=True) == "A"


def test_a_model_does_not_go_where_a_model_just_loaded_waits_for_its_first_call():
    # model-mesh calls a model the moment its load returns: a load sent there first would delay it.
    assert placed(last_called=False) == "B"


def test_a_model_does_not_go_into_a_pack_killed_and_not_yet_reaped():
    async def scenario():
        pack_set = packs.Packs(Settings.from_env({"MODELS_PER_WORKER": "4"}), StandInPool())
        dying, healthy = (pack_set.new_pack(StandInWorker(name), "python") for name in ("A", "B"))
        holding(dying, ready_model("first"), ready_model("second"))
        holding(healthy, ready_model("other"))
        dying.worker.state = WorkerState.CONDEMNED  # the fuller one, but its teardown has begun
        return (await pack_set._place(ready_model("new"), avoid=[])).worker.name

    assert asyncio.run(scenario()) == "B"
