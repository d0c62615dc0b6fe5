"""bench/report.py: the per-call table compares the right points and decides PASS and MISS by each bound."""

from __future__ import annotations

from bench.cpulimit import SETTINGS
from bench.payloads import BIG, SMALL
from bench.report import per_call_targets, print_per_call, targets


def point(case: str, payload: str, c: int, req_s: float, cpu_us: float, faults: float) -> dict:
    return {
        "case": case,
        "payload": payload,
        "concurrency": c,
        "req_s": req_s,
        "server_cpu_us_per_req": cpu_us,
        "page_faults_per_req": faults,
    }


def points(mesh_cpu: float, mesh_faults: float, mesh_big_req_s: float, iris_req_s: float) -> list[dict]:
    made = []
    for c in (1, 8, 16):
        made += [
            point("(a) grpc.aio canned", SMALL, c, 2000, 400, 0),
            point("(a) grpc.aio canned", BIG, c, 700, 1500, 700),
            point("(a2) canned via a ZeroMQ hop", SMALL, c, 1300, 700, 0),
            point("(a') grpc.aio canned, uvloop", SMALL, c, 2200, 380, 0),
            point("(b) mesh-runtime echo", SMALL, c, 1500, mesh_cpu, 0),
            point("(b) mesh-runtime echo", BIG, c, mesh_big_req_s, 2000, mesh_faults),
            point("(c) mesh-runtime sklearn", SMALL, c, iris_req_s, 900, 0),
            point("(d) MLServer sklearn", SMALL, c, 1000, 1500, 0),
        ]
    return made


def verdicts(rows: list[dict]) -> dict[tuple[str, str], str]:
    return {(row["measure"], row["target"]): row["verdict"] for row in rows}


def test_figures_within_every_bound_pass():
    rows = per_call_targets(points(mesh_cpu=560, mesh_faults=1.5, mesh_big_req_s=500, iris_req_s=3100))
    assert set(verdicts(rows).values()) == {"PASS"}
    cpu_c1 = rows[0]
    assert (cpu_c1["value"], cpu_c1["other"]) == (560, 700) and abs(cpu_c1["ratio"] - 0.8) < 1e-9


def test_each_kind_of_figure_misses_on_its_own_side_of_its_bound():
    rows = per_call_targets(points(mesh_cpu=800, mesh_faults=50, mesh_big_req_s=400, iris_req_s=2900))
    got = verdicts(rows)
    assert got[("echo CPU per call, FP32 [1,4], c=1", "<= 1.1x one hop")] == "MISS"  # 800 / 700
    assert got[("echo CPU per call, FP32 [1,4], c=8", "<= 1.5x bare")] == "MISS"  # 800 / 400
    assert got[("echo page faults per call, 1 MiB, c=1", "< 50")] == "MISS"  # 50 is not below 50
    assert got[("echo req/s, 1 MiB, c=8", ">= 0.6x bare")] == "MISS"  # 400 / 700
    assert got[("iris req/s, FP32 [1,4], c=16", ">= 3x MLServer")] == "MISS"  # 2900 / 1000


def test_a_missing_point_is_not_applicable_and_still_prints(capsys):
    without_mlserver = [p for p in points(560, 1.5, 500, 3100) if not p["case"].startswith("(d)")]
    rows = per_call_targets(without_mlserver)
    iris = [row for row in rows if row["measure"].startswith("iris")]
    assert iris and all(row["verdict"] == "n/a" for row in iris)
    print_per_call(rows)
    printed = capsys.readouterr().out
    assert "n/a (no (c) or (d) point)" in printed and "PASS" in printed


def test_the_polling_reference_compares_b_prime_with_b_and_never_passes_or_misses():
    polling = [point("(b') mesh-runtime echo, polling", SMALL, c, 1800, 700, 0) for c in (1, 8, 16)]
    made = polling + points(560, 1.5, 500, 3100)  # before (b): the first point found is not (b')
    for p in made:
        p["p50_ms"] = 0.45 if p["case"].startswith("(b')") else 0.5
    rows = {row["measure"]: row for row in targets(made, None)}
    gap = rows["p50 (b') - p50 (b), FP32 [1,4], c=1"]
    assert abs(gap["value"] - -0.05) < 1e-9 and gap["verdict"] == ""
    ratio = rows["(b') / (b) req/s, FP32 [1,4], c=8"]
    assert ratio["value"] == 1800 / 1500 and ratio["verdict"] == ""
    assert rows["p50 (b) - p50 (a), FP32 [1,4], c=1"]["value"] == 0.0, "(b') is not taken for (b)"


def test_the_cpu_limit_report_judges_no_target_when_the_default_is_the_setting_it_is_compared_with(capsys):
    from bench.cpulimit import print_report

    def cpu_point(setting: str, c: int, req_s: float) -> dict:
        return {
            "setting": setting,
            "concurrency": c,
            "req_s": req_s,
            "p50_ms": 0.5,
            "p99_ms": 1.0,
            "server_cpu_us_per_req": 600,
            "rounds_req_s": [req_s],
        }

    figures = {
        "quota_cores": 1.0,
        "rounds": 1,
        "resolved": {"BUSY_POLL_US=1000": "up to 1000 µs", "BUSY_POLL_US=0": "off", "default": "off"},
        "points": [cpu_point(s, c, 1000 if s == "default" else 1200) for s in SETTINGS for c in (1, 8, 16)],
    }
    print_report(figures)
    printed = capsys.readouterr().out
    assert "the ratio is the rounds' noise" in printed and "MISS" not in printed  # 1000 / 1200 is noise
    figures["resolved"]["default"] = "up to 1000 µs after each request"
    print_report(figures)
    assert "MISS" in capsys.readouterr().out
