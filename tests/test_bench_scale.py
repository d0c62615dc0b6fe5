"""bench/scale.py end to end on a handful of models: every figure is measured, none is made up."""

import pytest
from harness import MiB

from bench import scale


@pytest.mark.slow  # loads, measures and kills workers for several seconds
@pytest.mark.parametrize("models_per_worker", [1, None], ids=["a worker each", "packs (the default)"])
def test_the_scale_benchmark_measures_a_few_python_models_from_outside(
    models_per_worker, monkeypatch, capsys
):
    # Python models only: the frameworks' fork servers would cost the start 3 s and serve none of them.
    monkeypatch.setenv("WORKER_PRELOAD", "numpy")
    monkeypatch.setattr(scale, "RANDOM_CALLS", 20)
    monkeypatch.setattr(scale, "IDLE_SECONDS", 0.5)
    monkeypatch.setattr(scale, "SETTLE_AFTER_UNLOAD_S", 0.5)
    loaders = 1 if models_per_worker == 1 else scale.LOADERS  # one at a time, or as model-mesh
    figures = scale.run("python", steps=(2, 4), models_per_worker=models_per_worker, loaders=loaders)
    assert figures["loaders"] == loaders
    system = figures["mesh-runtime"]
    assert "error" not in system, system["error"]
    assert [step["models"] for step in system["steps"]] == [2, 4]
    packed = models_per_worker is None
    for step in system["steps"]:
        # A worker each, or one pack that holds them all.
        assert step["growth_bytes"] > (1 if packed else step["models"]) * MiB
        if packed:  # a pack not yet full: its base is in capacity's hold-back, not yet in the sizes
            assert 0 < step["reported_over_growth"] < 1 <= step["with_held_back_over_growth"]
        else:
            assert 0.5 < step["reported_over_growth"] < 2
        assert 0 < step["first_call_p50_ms"] and 0 < step["infer_p50_ms"] <= step["infer_p99_ms"]
        # The front, the fork server, the workers.
        assert step["processes"] >= (1 if packed else step["models"]) + 2
        assert step["front_fds"] > 0 and step["idle_cpu_percent"] >= 0
    faults = system["faults"]  # at the last step: fewer than FAULTS_AT models were asked for
    assert faults["models"] == 4 and faults["killed"] == 1
    assert faults["models_killed"] == faults["answering_again"]
    if packed:  # two loads at once go to two packs: the killed one held some of the four
        assert 1 <= faults["models_killed"] <= 4
    else:
        assert faults["models_killed"] == 1
    assert faults["calls"] > 0 and faults["unexpected_calls"] == 0
    assert faults["slowest_call_s"] < faults["deadline_s"] and faults["heal_s"] > 0
    if packed:
        assert 0 < faults["reported_over_growth"] < 1 <= faults["with_held_back_over_growth"]
    else:
        assert 0.5 < faults["reported_over_growth"] < 2
    assert system["unload_all_s"] > 0 and abs(system["left_bytes"]) < 64 * MiB
    if system["method"].startswith("cgroup"):  # the part of what is left that is page cache
        assert abs(system["left_page_cache_bytes"]) <= abs(system["left_bytes"]) + 64 * MiB
        assert all(step["reported_over_growth_without_cache"] > 0 for step in system["steps"])
    scale.print_report(figures)
    shown = capsys.readouterr().out
    assert "growth per model, MiB" in shown and "mesh-runtime python N=4" in shown
    assert "reported / (growth less the page cache's change)" in shown
    assert "faults at N=4" in shown
