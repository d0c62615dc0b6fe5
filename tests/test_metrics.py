"""runtime/metrics.py: inference calls are tallied per model and method, and scraped as Prometheus samples."""

from prometheus_client import generate_latest

from runtime.metrics import LATENCY_BUCKETS, Metrics


def samples(metrics: Metrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def test_calls_become_counts_by_code_and_a_cumulative_histogram():
    metrics = Metrics()
    for seconds in (0.0002, LATENCY_BUCKETS[0], 0.003, 100.0):
        metrics.observe_call("m", "ModelInfer", "OK", seconds)
    metrics.observe_call("m", "ModelInfer", "INVALID_ARGUMENT", 0.0001)
    got = samples(metrics)
    labels = 'method="ModelInfer",model="m"'
    assert got[f'mesh_requests_total{{code="OK",{labels}}}'] == 4
    assert got[f'mesh_requests_total{{code="INVALID_ARGUMENT",{labels}}}'] == 1
    # A call of exactly a bucket's bound counts in that bucket ("le"); 100 s only in +Inf.
    assert got[f'mesh_request_seconds_bucket{{le="0.0005",{labels}}}'] == 3
    assert got[f'mesh_request_seconds_bucket{{le="0.005",{labels}}}'] == 4
    assert got[f'mesh_request_seconds_bucket{{le="30.0",{labels}}}'] == 4
    assert got[f'mesh_request_seconds_bucket{{le="+Inf",{labels}}}'] == 5
    assert got[f"mesh_request_seconds_count{{{labels}}}"] == 5
    assert abs(got[f"mesh_request_seconds_sum{{{labels}}}"] - 100.0038) < 1e-9


def test_forgetting_a_model_removes_its_series_only():
    metrics = Metrics()
    metrics.observe_call("gone", "ModelInfer", "OK", 0.001)
    metrics.observe_call("kept", "ModelInfer", "OK", 0.001)
    metrics.observe_restart("gone", "crash")
    metrics.forget_model("gone")
    text = generate_latest(metrics.registry).decode()
    assert 'model="gone"' not in text
    assert 'mesh_requests_total{code="OK",method="ModelInfer",model="kept"} 1.0' in text
