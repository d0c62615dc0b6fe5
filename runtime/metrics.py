"""Prometheus metrics, kept in the front (workers report nothing themselves).

The front sees every call, load, unload and worker death go by, so counters
and histograms are updated where those happen; gauges (queue depth, memory,
capacity, spares) are read from the supervisor when Prometheus scrapes. The
HTTP endpoint runs in prometheus_client's own thread on METRICS_PORT, off the
request path.

Label values for `model` are only ever ids of loaded models, and a model's
series are removed when it goes: a client sending random ids cannot grow the
metric set.
"""
from __future__ import annotations

import collections

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("mesh_requests", "Inference calls answered, by model, method and gRPC code",
                                ["model", "method", "code"], registry=self.registry)
        self.latency = Histogram("mesh_request_seconds", "Time to answer an inference call, in the front",
                                 ["model", "method"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.loads = Counter("mesh_loads", "loadModel calls by outcome", ["outcome"], registry=self.registry)
        self.load_seconds = Histogram("mesh_load_seconds", "Time to load a model, by outcome", ["outcome"],
                                      buckets=LOAD_BUCKETS, registry=self.registry)
        self.unloads = Counter("mesh_unloads", "Models unloaded (unloadModel, purge or a dropped model)",
                               registry=self.registry)
        self.restarts = Counter("mesh_worker_restarts", "Model workers that died and were replaced, by cause",
                                ["model", "cause"], registry=self.registry)
        self._series = collections.defaultdict(set)  # model -> label tuples to remove when it goes
        self._calls: dict[tuple[str, str, str], tuple] = {}

    def serve(self, port: int, supervisor) -> None:
        self.registry.register(_StateCollector(supervisor))
        start_http_server(port, registry=self.registry)

    def observe_call(self, model_id: str, method: str, code: str, seconds: float) -> None:
        # The labelled children are cached: labels() costs more than the update itself.
        children = self._calls.get((model_id, method, code))
        if children is None:
            children = self._calls[model_id, method, code] = (
                self.requests.labels(model_id, method, code), self.latency.labels(model_id, method))
            self._series[model_id].add((method, code))
        children[0].inc()
        children[1].observe(seconds)

    def observe_load(self, outcome: str, seconds: float) -> None:
        self.loads.labels(outcome).inc()
        self.load_seconds.labels(outcome).observe(seconds)

    def observe_restart(self, model_id: str, cause: str) -> None:
        self.restarts.labels(model_id, cause).inc()
        self._series[model_id].add(("restart", cause))

    def forget_model(self, model_id: str) -> None:
        self.unloads.inc()
        for first, second in self._series.pop(model_id, ()):
            if first == "restart":
                self.restarts.remove(model_id, second)
                continue
            self.requests.remove(model_id, first, second)
            self._calls.pop((model_id, first, second), None)
            try:
                self.latency.remove(model_id, first)
            except KeyError:
                pass  # removed with an earlier code of the same method


class _StateCollector:
    """Gauges read from the supervisor at scrape time (in the metrics thread)."""

    def __init__(self, supervisor):
        self.supervisor = supervisor

    def collect(self):
        models = self.supervisor.models()  # a snapshot list: safe to walk from this thread
        waiting = GaugeMetricFamily("mesh_queue_depth", "Calls waiting for a free worker, per model", labels=["model"])
        size = GaugeMetricFamily("mesh_model_memory_bytes", "Measured memory (USS) of each loaded model",
                                 labels=["model"])
        ready = GaugeMetricFamily("mesh_model_ready_replicas", "Workers ready to serve each model", labels=["model"])
        for model in models:
            waiting.add_metric([model.model_id], model.replicas.waiting)
            size.add_metric([model.model_id], model.size)
            ready.add_metric([model.model_id], len(model.replicas.workers))
        yield from (waiting, size, ready)
        used = sum(m.size for m in models)
        capacity = self.supervisor.capacity_bytes
        yield GaugeMetricFamily("mesh_capacity_bytes", "capacityInBytes reported to model-mesh", value=capacity)
        yield GaugeMetricFamily("mesh_capacity_used_bytes", "Memory the loaded models use", value=used)
        yield GaugeMetricFamily("mesh_capacity_free_bytes", "Capacity not used by loaded models",
                                value=max(0, capacity - used))
        yield GaugeMetricFamily("mesh_warm_spares", "Idle workers ready for the next load",
                                value=len(self.supervisor.pool.spares()))
