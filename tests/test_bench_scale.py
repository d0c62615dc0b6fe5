"""bench/scale.py end to end on a handful of models: every figure is measured, none is made up."""

import pytest
from harness import MiB

from bench import scale


@pytest.mark.slow  # starts a runtime that preloads every installed framework
def test_the_scale_benchmark_measures_a_few_python_models_from_outside(monkeypatch, capsys):
    monkeypatch.setattr(scale, "RANDOM_CALLS", 20)
    monkeypatch.setattr(scale, "IDLE_SECONDS", 0.5)
    figures = scale.run("python", steps=(2, 4))
    system = figures["mesh-runtime"]
    assert "error" not in system, system["error"]
    assert [step["models"] for step in system["steps"]] == [2, 4]
    for step in system["steps"]:
        assert step["growth_bytes"] > step["models"] * MiB  # a worker each, at least
        assert 0.5 < step["reported_over_growth"] < 2
        assert 0 < step["first_call_p50_ms"] and 0 < step["infer_p50_ms"] <= step["infer_p99_ms"]
        assert step["processes"] >= step["models"] + 2  # the front, the fork server, the workers
        assert step["front_fds"] > 0 and step["idle_cpu_percent"] >= 0
    faults = system["faults"]  # at the last step: fewer than FAULTS_AT models were asked for
    assert faults["models"] == 4 and faults["killed"] == 1 and faults["answering_again"] == 1
    assert faults["calls"] > 0 and faults["unexpected_calls"] == 0
    assert faults["slowest_call_s"] < faults["deadline_s"] and faults["heal_s"] > 0
    assert 0.5 < faults["reported_over_growth"] < 2
    assert system["unload_all_s"] > 0 and abs(system["left_bytes"]) < 64 * MiB
    scale.print_report(figures)
    shown = capsys.readouterr().out
    assert "growth per model, MiB" in shown and "mesh-runtime python N=4" in shown
    assert "faults at N=4" in shown
