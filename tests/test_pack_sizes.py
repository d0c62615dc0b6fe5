"""What runtime/packs.py charges packed models, with the pack's measurements scripted.

No process runs here: the pool hands out one stand-in worker and answers every
load, and memory.cost_or_zero() and memory.anonymous() read the pack's cost
from a script, so that
each figure below is exact.
"""

from __future__ import annotations

import asyncio
import types

from standins import StandInChannel

from runtime import memory, packs
from runtime.pack import RECYCLE_SLACK_BYTES, Pack
from runtime.settings import Settings
from runtime.worker import WorkerState

KiB = 1024
BASE = 4000 * KiB  # what the spare costs before its first model
PER_PACK = 4


FIRST_USE = 700 * KiB  # what the pack's first load writes that later loads reuse
FIRST_CALLS = 300 * KiB  # the format's first_calls_bytes: what calls add after the last load


class StandInWorker:
    pid = 4242
    alive = serving = True
    state = WorkerState.SERVING
    identity = b"w"

    def __init__(self):
        self.models: set[str] = set()


class ScriptedPool:
    """Hands out one worker and answers loads and drops; the pack's cost moves by what each load is
    told to add, and by FIRST_USE at its first load, which no drop gives back."""

    def __init__(self, monkeypatch, adds: dict[str, int]):
        self.channel = StandInChannel()
        self.worker = StandInWorker()
        self.cost = BASE
        self.adds = adds
        self.loads = 0
        monkeypatch.setattr(memory, "cost_or_zero", lambda pid: self.cost)
        monkeypatch.setattr(memory, "anonymous", lambda pid: self.cost)

    async def take(self, format_name):
        return self.worker

    async def send_load(self, worker, model_id, format_name, path, pack=False):
        self.cost += self.adds[model_id] + (FIRST_USE if not self.loads else 0)
        self.loads += 1
        worker.models.add(model_id)
        return {"ok": True}

    async def send_drop(self, worker, model_id):
        self.cost -= self.adds[model_id]
        worker.models.discard(model_id)
        return {"ok": True}

    def replenish(self):
        pass


def model(model_id: str):
    fmt = types.SimpleNamespace(name="python", first_calls_bytes=FIRST_CALLS)
    spec = types.SimpleNamespace(format=fmt, path="/m")
    return types.SimpleNamespace(model_id=model_id, spec=spec, workers=[], ready=True, called=False)


def load_all(monkeypatch, adds: dict[str, int]) -> tuple[dict[str, int], ScriptedPool]:
    settings = Settings.from_env({"MODELS_PER_WORKER": str(PER_PACK)})
    pool = ScriptedPool(monkeypatch, adds)
    pack_set = packs.Packs(settings, pool)

    async def run():
        return {model_id: (await pack_set.load(model(model_id), []))[2] for model_id in adds}

    return asyncio.run(run()), pool


def base_share() -> int:
    return (BASE + FIRST_USE + memory.FRONT_SHARE_BYTES + FIRST_CALLS) // PER_PACK


def growth_parts(sizes: dict[str, int]) -> dict[str, int]:
    """Each size less its share of the base and what the front holds for the model."""
    extra = packs.DROP_LEFTOVER_BYTES + memory.FRONT_MODEL_BYTES
    return {model_id: size - base_share() - extra for model_id, size in sizes.items()}


def test_a_load_that_refills_freed_heap_is_not_charged_that_heap_again(monkeypatch):
    # The heap grows in steps: the first loads take a step each, the next ones fit into them.
    sizes, pool = load_all(monkeypatch, adds={"a": 132 * KiB, "b": 132 * KiB, "c": 0, "d": 0})
    growths = growth_parts(sizes)
    assert growths["c"] == growths["d"] == packs.PACKED_MODEL_MIN_BYTES
    # What the pack grew by is charged once in all, plus the least charge of the loads that added nothing.
    assert sum(growths.values()) == 2 * 132 * KiB + 2 * packs.PACKED_MODEL_MIN_BYTES


def test_credit_from_least_charges_is_used_up_by_the_next_growth(monkeypatch):
    sizes, pool = load_all(monkeypatch, adds={"a": 100 * KiB, "b": 100 * KiB, "c": 0, "d": 100 * KiB})
    growths = growth_parts(sizes)
    # c was charged the least charge before it grew anything; d's growth pays for what is left.
    assert growths["d"] == 100 * KiB - packs.PACKED_MODEL_MIN_BYTES
    assert sum(growths.values()) == 300 * KiB


def test_the_sizes_of_a_full_pack_add_up_to_what_it_costs(monkeypatch):
    sizes, pool = load_all(monkeypatch, adds={"a": 20 * KiB, "b": 20 * KiB, "c": 30 * KiB, "d": 10 * KiB})
    # The first calls the format's worker would make are charged before they are made, and so
    # is what later drops may leave behind.
    per_model = memory.FRONT_MODEL_BYTES + packs.DROP_LEFTOVER_BYTES
    whole = pool.cost + memory.FRONT_SHARE_BYTES + PER_PACK * per_model + FIRST_CALLS
    assert whole - PER_PACK <= sum(sizes.values()) <= whole  # the base's shares round down
    # The first load ran twice, so its first-use cost is in the base, not in the first model's size.
    assert growth_parts(sizes)["a"] == 20 * KiB


def test_the_predicted_size_of_a_packed_model_covers_what_it_is_then_charged(monkeypatch):
    settings = Settings.from_env({"MODELS_PER_WORKER": str(PER_PACK)})
    pool = ScriptedPool(monkeypatch, adds={"a": 20 * KiB, "b": 200 * KiB})
    pack_set = packs.Packs(settings, pool)
    spec = model("a").spec
    spec.disk_bytes, spec.format.size_floor = 2 * KiB, 8000 * KiB

    async def run():
        first_guess = pack_set.predicted_size(spec)  # no pack measured yet: floors of the format
        charged_a = (await pack_set.load(model("a"), []))[2]
        second_guess = pack_set.predicted_size(spec)  # from the base the pack measured
        charged_b = (await pack_set.load(model("b"), []))[2]
        return first_guess, charged_a, second_guess, charged_b

    first_guess, charged_a, second_guess, charged_b = asyncio.run(run())
    assert first_guess >= charged_a and second_guess >= charged_b
    extra = packs.DROP_LEFTOVER_BYTES + memory.FRONT_MODEL_BYTES
    assert second_guess == packs.PACKED_PREDICTION_MIN_BYTES + base_share() + extra
    floors = packs.PREDICTED_BASE_PER_FLOOR * 8000 * KiB
    assert first_guess == packs.PACKED_PREDICTION_MIN_BYTES + floors // PER_PACK + extra


def test_what_drops_gave_back_beyond_their_loads_does_not_hide_what_later_drops_keep():
    pack = Pack(StandInWorker(), "python")
    for _ in range(4):  # models whose calls cached 4 MiB after their loads were measured, dropped
        pack.note_left_over(-4096 * KiB)
    # A drop keeping over twice the slack (heap a model leaves in a module) is a recycle at once.
    assert pack.note_left_over(2 * RECYCLE_SLACK_BYTES + KiB) > RECYCLE_SLACK_BYTES
