"""bench/pack_recycle.py and bench/pack_churn.py end to end, small: every figure is measured."""

import pytest
from harness import MiB

from bench import pack_churn, pack_recycle


def test_the_recycle_benchmark_recycles_a_pack_per_round_and_no_call_fails(monkeypatch, capsys):
    monkeypatch.setattr(pack_recycle, "BASELINE_S", 0.2)
    figures = pack_recycle.run(rounds=2)
    assert figures["recycles"] == 2, "each unload of the keeping model recycled its pack"
    assert figures["failed_calls"] == []
    assert figures["calls_without"] > 0 and figures["calls_during"] > 0
    assert 0 < figures["plain_unload_p50_ms"] <= figures["plain_unload_p99_ms"]
    assert 0 < figures["recycling_unload_p50_ms"] <= figures["recycling_unload_p99_ms"]
    print("\n".join(pack_recycle.describe(figures)))
    assert "unloadModel with a recycle" in capsys.readouterr().out


@pytest.mark.slow  # 200 operations on a pod kept full, settled at each checkpoint
def test_the_churn_benchmark_keeps_a_small_pod_full_and_compares_sizes_at_each_checkpoint(monkeypatch):
    # Python models only: the frameworks' fork servers would cost the start 3 s and serve none of them.
    monkeypatch.setenv("WORKER_PRELOAD", "numpy")
    monkeypatch.setattr(pack_churn, "POOL", 60)
    monkeypatch.setattr(pack_churn, "CHECKPOINT", 100)
    monkeypatch.setattr(pack_churn, "CAPACITY_BYTES", 8 * MiB)
    figures = pack_churn.run(ops=200)
    assert "error" not in figures, figures["error"]
    assert [p["ops"] for p in figures["points"]] == [0, 100, 200]
    last = figures["points"][-1]
    assert last["loads"] > figures["filled_with"] and last["evictions"] > 0 and last["infers"] > 0
    assert not [k for k in last if k.startswith("infer ")], "every call answered OK"
    for point in figures["points"]:
        assert point["reported_bytes"] <= 8 * MiB and point["growth_bytes"] > 0
        assert point["with_held_back_over_growth"] >= point["reported_over_growth"] > 0
        assert point["page_cache_change_bytes"] is None or isinstance(point["page_cache_change_bytes"], int)
    assert isinstance(figures["slow_load_moves"], int)  # counted from the runtime's log
    lines = pack_churn.describe(figures)
    assert "move their pack's other models out" in lines[-1]
    if figures["method"].startswith("cgroup"):  # a cgroup tells its page cache apart
        assert len(lines) == 1 + 3 + 4
        for point in figures["points"]:
            growth = point["growth_bytes"] - point["page_cache_change_bytes"]
            assert point["reported_over_growth_without_cache"] == point["reported_bytes"] / growth
        assert "page cache" in lines[1] and "less the page cache's change" in lines[5]
    else:
        assert len(lines) == 1 + 3 + 3
