"""bench/common.py damon_reclaim: the benchmark names the kernel's schemes that page memory out on their
own, which make a cgroup's usage fall over a long run (a tree written under tmp_path stands for sysfs)."""

from __future__ import annotations

from bench.common import damon_reclaim


def scheme(root, kdamond: str, state: str, actions: list[str]) -> None:
    folder = root / kdamond
    folder.mkdir(parents=True)
    (folder / "state").write_text(state + "\n")
    (folder / "nr_contexts").write_text("1\n")  # sysfs files beside the numbered folders are skipped
    for index, action in enumerate(actions):
        path = folder / "contexts" / "0" / "schemes" / str(index)
        path.mkdir(parents=True)
        (path / "action").write_text(action + "\n")


def test_a_running_pageout_scheme_is_named_and_others_are_not(tmp_path):
    scheme(tmp_path, "0", "on", ["stat", "pageout"])
    scheme(tmp_path, "1", "off", ["pageout"])  # not running
    scheme(tmp_path, "2", "on", ["lru_deprio"])
    assert damon_reclaim(str(tmp_path)) == ["kdamond 0: pageout", "kdamond 2: lru_deprio"]


def test_no_damon_names_nothing(tmp_path):
    assert damon_reclaim(str(tmp_path / "absent")) == []
    scheme(tmp_path, "0", "on", ["stat"])
    assert damon_reclaim(str(tmp_path)) == []
