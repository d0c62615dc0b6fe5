"""Which ready models a pack's death counts against (runtime/healing.py blamed())."""

from __future__ import annotations

import types

from runtime.healing import blamed
from workers import protocol


def pack_that_died(running_main: str | None, with_calls: set[str]):
    """A dead pack whose main thread ran `running_main`'s code, with calls of `with_calls` in it."""
    tag = protocol.model_tag(running_main) if running_main else protocol.NOTHING_RUNNING
    return types.SimpleNamespace(last_running=tag, running=frozenset(with_calls))


MODELS = [types.SimpleNamespace(model_id=m) for m in ("a", "b", "c")]


def ids(models) -> list[str]:
    return [m.model_id for m in models]


def test_the_model_whose_call_the_main_thread_ran_alone():
    assert ids(blamed(MODELS, pack_that_died("a", {"a", "b"}))) == ["a"]


def test_a_load_or_drop_on_the_main_thread_counts_against_none_of_the_ready_models():
    # Calls in it waited behind the load of g, or ran beside it on call threads: a load that
    # crashes its pack must not drop a neighbour that was only busy.
    assert blamed(MODELS, pack_that_died("g", {"b"})) == []


def test_a_pack_that_died_idle_counts_against_all_its_models_or_those_with_calls_on_call_threads():
    assert ids(blamed(MODELS, pack_that_died(None, set()))) == ["a", "b", "c"]
    assert ids(blamed(MODELS, pack_that_died(None, {"c"}))) == ["c"]
