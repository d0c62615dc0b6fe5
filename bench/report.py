"""The benchmark's tables: figures against their targets, each row PASS or MISS.

The life-cycle table (load latency, idle spare USS, memory returned, predictModelSize) and
the data-plane table with the ratios its targets are set in. A target missed is MISS, never
an error: benchmarks report, they do not fail.
"""

from __future__ import annotations

from bench.common import MiB
from bench.h2load import CHECK_CALLS, POST_CHECK_CALLS
from bench.lifecycle import ALLOC_MIB, SIZE_CALLS
from bench.payloads import BIG, SMALL

# -- the life-cycle table ---------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def rows_load(r: dict, loads: int) -> list[tuple]:
    return [
        (
            f"load from warm spare, p50 ({loads} loads)",
            f"{r['load_p50_ms']:.1f} ms",
            "p50 <= 10 ms",
            verdict(r["load_p50_ms"] <= 10),
        ),
        ("load from warm spare, p99", f"{r['load_p99_ms']:.1f} ms", "", ""),
        ("unload, p50 / p99", f"{r['unload_p50_ms']:.1f} / {r['unload_p99_ms']:.1f} ms", "", ""),
    ]


def rows_idle(r: dict) -> list[tuple]:
    each = ", ".join(f"{s:.2f}" for s in r["spare_uss_mib"])
    return [
        ("idle spare USS, median", f"{r['median_mib']:.2f} MiB", "<= 6 MiB", verdict(r["median_mib"] <= 6)),
        ("idle spare USS, each", f"{each} MiB", "", ""),
    ]


def rows_memory(r: dict) -> list[tuple]:
    return [
        ("tree USS before load (settled)", f"{r['before_mib']:.1f} MiB", "", ""),
        (f"tree USS with {ALLOC_MIB} MiB model", f"{r['loaded_mib']:.1f} MiB", "", ""),
        ("  measured growth", f"{r['growth_mib']:.1f} MiB", "", ""),
        ("  reported sizeInBytes", f"{r['reported_mib']:.1f} MiB", "", ""),
        ("  ratio reported / growth", f"{r['ratio']:.3f}", "1 +- 10 %", verdict(abs(r["ratio"] - 1) <= 0.10)),
        ("tree USS after unload (settled)", f"{r['after_mib']:.1f} MiB", "", ""),
        (
            "  after - before",
            f"{r['returned_diff_mib']:+.2f} MiB",
            "within 2 MiB",
            verdict(abs(r["returned_diff_mib"]) <= 2),
        ),
    ]


def rows_size(r: dict) -> list[tuple]:
    return [
        (
            f"predictModelSize, p50 ({SIZE_CALLS} calls)",
            f"{r['p50_ms']:.2f} ms",
            "< 5 ms",
            verdict(r["p50_ms"] < 5),
        ),
        ("predictModelSize, p99", f"{r['p99_ms']:.2f} ms", "< 5 ms", verdict(r["p99_ms"] < 5)),
        (
            "  predicted size of the echo model",
            " / ".join(f"{b / MiB:.1f}" for b in r["size_bytes"]) + " MiB",
            "",
            "",
        ),
    ]


def print_lifecycle(sections: list[tuple[str, list[tuple]]]) -> None:
    header = ("measure", "value", "target", "")
    widths = [max(len(str(row[i])) for _, rows in sections for row in [header, *rows]) for i in range(4)]
    line = "  ".join("-" * w for w in widths)

    def show(row):
        print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())

    show(header)
    for title, rows in sections:
        print(line)
        print(title)
        for row in rows:
            show(row)


# -- the data-plane table ---------------------------------------------------------------------


def _find(points: list[dict], case_prefix: str, payload: str, c: int) -> dict | None:
    for p in points:
        if p["case"].startswith(case_prefix) and p["payload"] == payload and p["concurrency"] == c:
            return None if "error" in p else p
    return None


def targets(points: list[dict], peer: str | None) -> list[dict]:
    """The data-plane targets: each with its value, or why it has none."""

    def ratio(name, num, den, c, payload, goal, peer_needed=False):
        """goal None: a ratio shown for reading the others, with no target of its own."""
        a, b = _find(points, num, payload, c), _find(points, den, payload, c)
        if goal is None:
            target = "(reference)"
        else:
            target = f">= {goal:g}x" if goal >= 1 else f">= {goal:.0%}"
        row = {"measure": name, "target": target}
        if a and b:
            value = a["req_s"] / b["req_s"]
            show = (lambda v: f"{v:.2f}x") if goal and goal >= 1 else (lambda v: f"{v:.0%}")
            # With --rounds, the same ratio within each round too (rounds are interleaved,
            # so a burst of noise hits both sides of a round alike).
            rounds = zip(a.get("rounds_req_s", []), b.get("rounds_req_s", []), strict=False)
            per_round = [x / y for x, y in rounds]
            shown = show(value) + (
                f" (rounds: {' '.join(map(show, per_round))})" if len(per_round) > 1 else ""
            )
            verdict = "" if goal is None else "PASS" if value >= goal else "MISS"
            row.update(value=value, rounds=per_round, shown=shown, verdict=verdict)
        else:
            row.update(
                value=None,
                shown="n/a",
                verdict="" if peer_needed and not peer else "n/a",
                why="needs --peer mlserver" if peer_needed and not peer else "a point failed",
            )
        return row

    rows = [
        ratio("(b) / (a) req/s, FP32 [1,4], c=16", "(b)", "(a)", 16, SMALL, 0.60),
        ratio("(c) / (d) req/s, FP32 [1,4], c=16", "(c)", "(d)", 16, SMALL, 3, True),
    ]

    def p50_gap(name, num, den, limit):
        """p50 of `num` minus p50 of `den` at one client; limit None: a reference."""
        a, b = _find(points, den, SMALL, 1), _find(points, num, SMALL, 1)
        row = {"measure": name, "target": "(reference)" if limit is None else f"<= {limit:.2f} ms"}
        if a and b:
            value = b["p50_ms"] - a["p50_ms"]
            verdict = "" if limit is None else "PASS" if value <= limit else "MISS"
            row.update(value=value, shown=f"{value:+.3f} ms", verdict=verdict)
        else:
            row.update(value=None, shown="n/a", verdict="n/a", why="a point failed")
        return row

    rows.append(p50_gap("p50 (b) - p50 (a), FP32 [1,4], c=1", "(b)", "(a)", 0.40))
    rows.append(ratio("(b) / (a) req/s, 1 MiB, c=16", "(b)", "(a)", 16, BIG, 0.45))
    rows.append(ratio("(b) / (d) req/s, 1 MiB, c=16", "(b)", "(d)", 16, BIG, 5, True))
    # References: what uvloop alone gives (a), what the bare hop keeps of it, and what
    # mesh-runtime keeps of the hop.
    rows.append(ratio("(a') / (a) req/s, FP32 [1,4], c=16", "(a')", "(a)", 16, SMALL, None))
    rows.append(ratio("(b) / (a') req/s, FP32 [1,4], c=16", "(b)", "(a')", 16, SMALL, None))
    rows.append(ratio("(a2) / (a') req/s, FP32 [1,4], c=16", "(a2)", "(a')", 16, SMALL, None))
    rows.append(ratio("(b) / (a2) req/s, FP32 [1,4], c=16", "(b)", "(a2)", 16, SMALL, None))
    # What busy polling would change on this machine (it is off by default).
    rows.append(p50_gap("p50 (b') - p50 (b), FP32 [1,4], c=1", "(b')", "(b)", None))
    rows.append(ratio("(b') / (b) req/s, FP32 [1,4], c=8", "(b')", "(b)", 8, SMALL, None))
    return rows


# (measure, what is compared, (case, reference case), payload, concurrency, target, passes)
PER_CALL_TARGETS = (
    ("echo CPU per call, FP32 [1,4], c=1", "cpu", ("(b)", "(a2)"), SMALL, 1, "<= 1.1x one hop", 1.1),
    ("echo CPU per call, FP32 [1,4], c=8", "cpu", ("(b)", "(a2)"), SMALL, 8, "<= 1.1x one hop", 1.1),
    ("echo CPU per call, FP32 [1,4], c=8", "cpu", ("(b)", "(a)"), SMALL, 8, "<= 1.5x bare", 1.5),
    ("echo page faults per call, 1 MiB, c=1", "faults", ("(b)", "(a)"), BIG, 1, "< 50", 50),
    ("echo page faults per call, 1 MiB, c=8", "faults", ("(b)", "(a)"), BIG, 8, "< 50", 50),
    ("echo req/s, 1 MiB, c=1", "req_s", ("(b)", "(a)"), BIG, 1, ">= 0.6x bare", 0.6),
    ("echo req/s, 1 MiB, c=8", "req_s", ("(b)", "(a)"), BIG, 8, ">= 0.6x bare", 0.6),
    ("iris req/s, FP32 [1,4], c=8", "req_s", ("(c)", "(d)"), SMALL, 8, ">= 3x MLServer", 3),
    ("iris req/s, FP32 [1,4], c=16", "req_s", ("(c)", "(d)"), SMALL, 16, ">= 3x MLServer", 3),
)
_PER_CALL_FIELDS = {"cpu": "server_cpu_us_per_req", "faults": "page_faults_per_req", "req_s": "req_s"}


def per_call_targets(points: list[dict]) -> list[dict]:
    """CPU per call against the one-hop and bare servers, page faults and req/s with 1 MiB against the
    bare server, iris against MLServer: each row with both figures, their ratio and its verdict.

    CPU passes at or below its bound (a ratio), faults below theirs (a count, the reference's beside
    it), req/s at or above its bound (a ratio).
    """
    rows = []
    for measure, what, (case, reference), payload, c, target, bound in PER_CALL_TARGETS:
        ours, theirs = _find(points, case, payload, c), _find(points, reference, payload, c)
        row = {"measure": measure, "case": case, "reference": reference, "target": target}
        field = _PER_CALL_FIELDS[what]
        if ours is None or theirs is None or field not in ours or field not in theirs:
            row.update(value=None, ratio=None, verdict="n/a", why=f"no {case} or {reference} point")
            rows.append(row)
            continue
        value, other = ours[field], theirs[field]
        ratio = value / other if other else None
        if what == "faults":
            ok = value < bound
        elif what == "cpu":
            ok = ratio is not None and ratio <= bound
        else:
            ok = ratio is not None and ratio >= bound
        row.update(value=value, other=other, ratio=ratio, verdict=verdict(ok))
        rows.append(row)
    return rows


def _per_call_cell(what: str, value: float) -> str:
    return {"cpu": f"{value:,.0f} us", "faults": f"{value:,.1f}", "req_s": f"{value:,.0f}"}[what]


def print_per_call(rows: list[dict]) -> None:
    whats = {measure: what for measure, what, *_ in PER_CALL_TARGETS}
    table = []
    for row in rows:
        what = whats[row["measure"]]
        if row["value"] is None:
            table.append((row["measure"], "n/a", "", "", row["target"], f"n/a ({row['why']})"))
            continue
        table.append(
            (
                row["measure"],
                f"{row['case']} {_per_call_cell(what, row['value'])}",
                f"{row['reference']} {_per_call_cell(what, row['other'])}",
                "" if row["ratio"] is None else f"{row['ratio']:.2f}x",
                row["target"],
                row["verdict"],
            )
        )
    print()
    print("per call: CPU, big tensors, iris against MLServer (figures of the points above)")
    _table(("measure", "mesh-runtime", "reference", "ratio", "target", ""), table)


def print_dataplane(figures: dict) -> None:
    print()
    rounds = f", median of {figures['rounds']} rounds" if figures["rounds"] > 1 else ""
    print(
        f"data plane: ModelInfer under h2load {figures['h2load']} (-m 1, -t 1), "
        f"{figures['duration_s']:g} s per point after a {figures['warmup_s']:g} s warm-up run, "
        f"cases interleaved{rounds}"
    )
    print(
        f"runtime under test: defaults ({', '.join(f'{k}={v}' for k, v in figures['runtime_env'].items())}, "
        f"MODEL_REPLICAS=1, WORKER_THREADS=1, LOG_LEVEL=info); "
        f"iris served by the {figures.get('iris_served_as', '?')}"
    )
    for note in figures["notes"]:
        print(note)
    print(
        f"each point: h2load -c C -m 1 -t 1 -D {figures['duration_s']:g}s -d BODY "
        "-H 'content-type: application/grpc' -H 'te: trailers' "
        "-H 'mm-model-id-bin: B64' -H 'mm-model-id: ID' http://127.0.0.1:PORT/inference.GRPCInferenceService/ModelInfer"
        " --log-file LOG (MLServer: no mm- headers, the model name in the request)"
    )
    print(f"load average before: {figures['load_average_before']:.2f}")
    header = ("case", "payload", "c", "req/s", "p50 ms", "p99 ms", "srv cpu/req", "faults/req", "other cpu")
    rows = []
    for p in figures["points"]:
        if "error" in p:
            rows.append(
                (p["case"], p["payload"], str(p["concurrency"]), "ERROR", p["error"][:70], "", "", "", "")
            )
        else:
            rows.append(
                (
                    p["case"],
                    p["payload"],
                    str(p["concurrency"]),
                    f"{p['req_s']:,.0f}",
                    f"{p['p50_ms']:.3f}",
                    f"{p['p99_ms']:.3f}",
                    f"{p['server_cpu_us_per_req']:.0f} us",
                    f"{p.get('page_faults_per_req', float('nan')):.1f}",
                    f"{p['other_cores']:.2f} cores",
                )
            )
    _table(header, rows)
    print()
    print("targets")
    _table(
        ("measure", "value", "target", ""),
        [
            (t["measure"], t["shown"], t["target"], t["verdict"] or (f"({t['why']})" if t.get("why") else ""))
            for t in figures["targets"]
        ],
    )
    print_per_call(figures["per_call_targets"])
    print(
        "\nsrv cpu/req: CPU time of the server's processes per request (mesh-runtime: front, fork server and "
        "workers); faults/req: their page faults per request (/proc/PID/stat); other cpu: what the rest "
        "of the machine used meanwhile"
    )
    print(
        f"check of every point: {CHECK_CALLS} grpc calls before and {POST_CHECK_CALLS} after it "
        "(status OK, expected outputs), nghttp grpc-status 0 for h2load's body, DATA bytes = "
        "requests x response size"
    )
    print(
        f"data-plane section: {figures['seconds']:.0f} s ({figures['seconds_setup']:.0f} s of it "
        "starting servers and loading models)"
    )


def _table(header: tuple, rows: list[tuple]) -> None:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    numeric = {2, 3, 4, 5, 6, 7, 8} if len(header) == 9 else set()

    def show(row):
        cells = [
            str(c).rjust(w) if i in numeric and row is not header else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())

    show(header)
    print("  ".join("-" * w for w in widths))
    for row in rows:
        show(row)
