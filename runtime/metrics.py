"""Prometheus metrics, kept in the front (workers report nothing themselves).

The front sees every call, load, unload and worker death go by, so counters
and histograms are updated where those happen (inference calls into plain
tallies, the hot path); gauges (queue depth, memory, capacity, spares) are
read from the supervisor when Prometheus scrapes. The HTTP endpoint runs in
prometheus_client's own thread on METRICS_PORT, off the request path.

Label values for `model` are only ever ids of loaded models, and a model's
series are removed when it goes: a client sending random ids cannot grow the
metric set.
"""

from __future__ import annotations

import bisect
import collections

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class CallTally:
    """One model's calls of one method: counts by gRPC code, and their latency histogram.

    Plain numbers, updated on the event loop for every call and turned into
    Prometheus samples only when scraped: a prometheus_client Counter and
    Histogram take a lock per update and walk the buckets in Python, which
    cost the front more per call than all of this (callgrind).
    """

    __slots__ = ("codes", "buckets", "seconds")

    def __init__(self):
        self.codes: dict[str, int] = {}
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one is +Inf
        self.seconds = 0.0

    def add(self, code: str, seconds: float) -> None:
        self.codes[code] = self.codes.get(code, 0) + 1
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.seconds += seconds


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self._calls: dict[tuple[str, str], CallTally] = {}  # (model, method) -> its tally
        self.registry.register(_CallCollector(self._calls))
        self.loads = Counter("mesh_loads", "loadModel calls by outcome", ["outcome"], registry=self.registry)
        self.load_seconds = Histogram(
            "mesh_load_seconds",
            "Time to load a model, by outcome",
            ["outcome"],
            buckets=LOAD_BUCKETS,
            registry=self.registry,
        )
        self.unloads = Counter(
            "mesh_unloads", "Models unloaded (unloadModel, purge or a dropped model)", registry=self.registry
        )
        self.restarts = Counter(
            "mesh_worker_restarts",
            "Model workers that died and were replaced, by cause",
            ["model", "cause"],
            registry=self.registry,
        )
        self._restarted = collections.defaultdict(set)  # model -> causes, to remove when it goes
        self.pack_recycle_seconds = Histogram(
            "mesh_pack_recycle_seconds",
            "Pack recycles (a fresh worker took over a pack's models) and how long each took",
            buckets=LOAD_BUCKETS,
            registry=self.registry,
        )
        self.pack_models_moved = Counter(
            "mesh_pack_models_moved", "Models moved to a fresh pack by a recycle", registry=self.registry
        )

    def serve(self, port: int, supervisor) -> None:
        self.registry.register(_StateCollector(supervisor))
        start_http_server(port, registry=self.registry)

    def observe_call(self, model_id: str, method: str, code: str, seconds: float) -> None:
        tally = self._calls.get((model_id, method))
        if tally is None:
            tally = self._calls[model_id, method] = CallTally()
        tally.add(code, seconds)

    def observe_load(self, outcome: str, seconds: float) -> None:
        self.loads.labels(outcome).inc()
        self.load_seconds.labels(outcome).observe(seconds)

    def observe_pack_recycle(self, seconds: float, models_moved: int) -> None:
        self.pack_recycle_seconds.observe(seconds)
        self.pack_models_moved.inc(models_moved)

    def observe_restart(self, model_id: str, cause: str) -> None:
        self.restarts.labels(model_id, cause).inc()
        self._restarted[model_id].add(cause)

    def forget_model(self, model_id: str, unloaded: bool = True) -> None:
        """Drops the model's series; `unloaded`: it had loaded (a failed load is no unload)."""
        if unloaded:
            self.unloads.inc()
        for cause in self._restarted.pop(model_id, ()):
            self.restarts.remove(model_id, cause)
        for key in [key for key in self._calls if key[0] == model_id]:
            del self._calls[key]


_BOUNDS = (
    *map(floatToGoString, LATENCY_BUCKETS),
    "+Inf",
)  # the `le` labels, as prometheus_client writes them


class _CallCollector:
    """mesh_requests_total and mesh_request_seconds from the tallies, at scrape time (metrics thread)."""

    def __init__(self, calls: dict[tuple[str, str], CallTally]):
        self.calls = calls

    def collect(self):
        requests = CounterMetricFamily(
            "mesh_requests",
            "Inference calls answered, by model, method and gRPC code",
            labels=["model", "method", "code"],
        )
        latency = HistogramMetricFamily(
            "mesh_request_seconds",
            "Time to answer an inference call, in the front",
            labels=["model", "method"],
        )
        # list(): one step under the GIL, so the event loop cannot resize the dict mid-walk.
        for (model_id, method), tally in list(self.calls.items()):
            for code, count in list(tally.codes.items()):
                requests.add_metric([model_id, method, code], count)
            cumulative, buckets = 0, []
            for bound, count in zip(_BOUNDS, tally.buckets, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            latency.add_metric([model_id, method], buckets, sum_value=tally.seconds)
        yield requests
        yield latency


class _StateCollector:
    """Gauges read from the supervisor at scrape time (in the metrics thread)."""

    def __init__(self, supervisor):
        self.supervisor = supervisor

    def collect(self):
        models = self.supervisor.models()  # a snapshot list: safe to walk from this thread
        waiting = GaugeMetricFamily(
            "mesh_queue_depth", "Calls waiting for a free worker, per model", labels=["model"]
        )
        size = GaugeMetricFamily(
            "mesh_model_memory_bytes",
            "Reported size of each model (USS, kernel share; at least WORKERS_MAX's floor)",
            labels=["model"],
        )
        ready = GaugeMetricFamily(
            "mesh_model_ready_replicas", "Workers ready to serve each model", labels=["model"]
        )
        for model in models:
            waiting.add_metric([model.model_id], model.replicas.waiting)
            size.add_metric([model.model_id], model.size)
            ready.add_metric([model.model_id], len(model.replicas.workers))
        yield from (waiting, size, ready)
        used = sum(m.size for m in models)
        capacity = self.supervisor.capacity_bytes
        yield GaugeMetricFamily(
            "mesh_capacity_bytes", "capacityInBytes reported to model-mesh", value=capacity
        )
        yield GaugeMetricFamily(
            "mesh_capacity_used_bytes", "Sum of the loaded models' reported sizes", value=used
        )
        yield GaugeMetricFamily(
            "mesh_capacity_free_bytes", "Capacity not used by loaded models", value=max(0, capacity - used)
        )
        yield GaugeMetricFamily(
            "mesh_warm_spares",
            "Idle workers ready for the next load",
            value=len(self.supervisor.pool.spares()),
        )
