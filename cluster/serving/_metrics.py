"""Prometheus metrics of a model replica, through Ray Serve's metrics API.

    metrics = ReplicaMetrics(model_name)          # once, in the replica's __init__
    metrics.update(replica_stats)                 # whenever (e.g. after each batch)
    metrics.observe_request(seconds)              # optional: request latency histogram

`update` takes the replica's stats dict (`RuntimeStats.to_dict()`, the batching and
request counters, and an `ArtifactCache.stats()` dict under "store" when the replica
has one) and turns it into Prometheus series; the runtime's part is read back as a
`RuntimeStats`, the request counters as `RequestCounters` (dynvm.cluster._counters), and
both are read by attribute: a series names a field, checked when it is defined.
Counters in the stats are cumulative, so each update adds the increase since the
previous one; a value lower than before means the source restarted (a new Runtime) and
the whole value is added, so the Prometheus counter never goes down. Keys that are
absent (JIT off, no store) are skipped.

Ray exports every metric with a `ray_` prefix and counters with a `_total` suffix, on
each node's metrics export port (`ray start --metrics-export-port`); Serve adds the
`deployment`, `replica` and `application` tags, this module adds `model`:

    ray_dynvm_calls_total                  Runtime calls
    ray_dynvm_requests_total               inference requests (replica counter)
    ray_dynvm_request_errors_total         failed inference requests
    ray_dynvm_compiles_total               specializations compiled
    ray_dynvm_compile_seconds_total        time spent compiling
    ray_dynvm_compile_failures_total       compiles that failed
    ray_dynvm_guard_failures_total         guard failures (calls sent back to the VM)
    ray_dynvm_deopts_total                 specialized code that failed and deoptimized
    ray_dynvm_region_calls_total{kind=specialized|interpreted}
    ray_dynvm_store_fetches_total{result=hit|miss|rejected|unavailable}
    ray_dynvm_store_rejections_total{reason=unsigned|forged|corrupt|incompatible}
    ray_dynvm_store_publishes_total        artifacts this replica published
    ray_dynvm_store_dropped_total{reason=oversized|evicted|expired}
                                           entries its store left out or deleted
    ray_dynvm_specialized_ratio            specialized / all region calls, since start
    ray_dynvm_families                     installed code-family kernels
    ray_dynvm_specializations              installed exact/weak specializations
    ray_dynvm_arena_bytes{state=reserved|in_use}
    ray_dynvm_compile_queue_length         compile tasks waiting
    ray_dynvm_request_seconds              histogram, from observe_request

The specialized ratio over a recent window is a PromQL rate of the region-call counters:
    sum(rate(ray_dynvm_region_calls_total{kind="specialized"}[5m])) by (model)
      / sum(rate(ray_dynvm_region_calls_total[5m])) by (model)
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from ray.serve import metrics

from dynvm._runtime_stats import RuntimeStats
from dynvm.cluster._counters import RequestCounters, field_of, read
from dynvm.cluster.store._signed import REJECTIONS

MODEL_TAG = "model"
REQUEST_SECONDS_BOUNDARIES = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0,
                              2.0, 5.0, 10.0]


@dataclass(frozen=True)
class Series:
    """One exported series: a metric name, its extra tags, and where its value is: a
    RuntimeStats attribute, a RequestCounters field, or keys into the store's stats."""

    metric: str
    """Name given to Ray (exported as ray_<metric>, plus _total for a counter)."""
    description: str
    """The Prometheus HELP text."""
    runtime: str = ""
    """The RuntimeStats attribute holding the value ("" when it is the replica's)."""
    path: tuple[str, ...] = ()
    """Keys to the value: into the `runtime` attribute's mapping when that is set, else
    into the replica's stats dict (the store's counters, under "store")."""
    tags: Mapping[str, str] = field(default_factory=dict)
    """Tags beside `model` (the same keys for every series of one metric)."""
    requests: str = ""
    """The RequestCounters field holding the value ("" when it is not one)."""

    def __post_init__(self) -> None:
        # A series that names a field no type has fails here, at import, not by
        # silently exporting nothing.
        if self.runtime and self.runtime not in _RUNTIME_NAMES:
            raise AttributeError(f"RuntimeStats has no attribute {self.runtime!r}")
        if self.requests:
            field_of(RequestCounters, self.requests)

    @property
    def key(self) -> str:
        """`metric{tag=value,...}`: how `update` reports what it recorded."""
        if not self.tags:
            return self.metric
        return self.metric + "{" + ",".join(f"{k}={v}" for k, v in self.tags.items()) + "}"


_RUNTIME_NAMES = frozenset({f.name for f in fields(RuntimeStats)} | {
    name for name, value in vars(RuntimeStats).items() if isinstance(value, property)})

_STORE_RESULTS = {"valid": "hit", "missing": "miss", "rejected": "rejected",
                  "unavailable": "unavailable"}

COUNTERS: tuple[Series, ...] = (
    Series("dynvm_calls", "Runtime calls.", "calls"),
    Series("dynvm_requests", "Inference requests received.", requests="requests"),
    Series("dynvm_request_errors", "Inference requests that failed.", requests="errors"),
    Series("dynvm_compiles", "Specializations compiled.", "compiles"),
    Series("dynvm_compile_seconds", "Seconds spent compiling.", "compile_seconds"),
    Series("dynvm_compile_failures", "Compiles that failed.", "compile_failures"),
    Series("dynvm_guard_failures", "Guard failures (calls sent back to the interpreter).",
           "guard_failures"),
    Series("dynvm_deopts", "Specialized calls that failed and deoptimized.", "deopts"),
    *(Series("dynvm_region_calls", "Region calls, specialized or interpreted.",
             f"{kind}_region_calls", tags={"kind": kind})
      for kind in ("specialized", "interpreted")),
    *(Series("dynvm_store_fetches", "Kernel store fetches by result.",
             path=("store", name), tags={"result": result})
      for name, result in _STORE_RESULTS.items()),
    *(Series("dynvm_store_rejections", "Artifacts rejected by reason.",
             path=("store", cls.reason), tags={"reason": cls.reason}) for cls in REJECTIONS),
    Series("dynvm_store_publishes", "Artifacts published to the kernel store.",
           path=("store", "published")),
    *(Series("dynvm_store_dropped", "Kernel store entries left out (over the size cap) "
             "or deleted (size bound, TTL), by reason.", path=("store", reason),
             tags={"reason": reason}) for reason in ("oversized", "evicted", "expired")),
)

GAUGES: tuple[Series, ...] = (
    Series("dynvm_specialized_ratio",
           "Specialized region calls / all region calls, since the runtime started.",
           "specialized_ratio"),
    Series("dynvm_families", "Installed code-family kernels.", "installed_families"),
    Series("dynvm_specializations", "Installed exact or weak specializations.",
           "installed_specializations"),
    *(Series("dynvm_arena_bytes", "Arena pool bytes.", "arena", (f"{state}_bytes",),
             {"state": state}) for state in ("reserved", "in_use")),
    Series("dynvm_compile_queue_length", "Compile tasks waiting.", "queue_length"),
)


def _number(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def _lookup(value, path: tuple[str, ...]) -> float | None:
    for key in path:
        if not isinstance(value, Mapping) or key not in value:
            return None
        value = value[key]
    return _number(value)


def _value(spec: Series, runtime: RuntimeStats, requests: RequestCounters,
           stats: Mapping) -> float | None:
    if spec.runtime:
        return _lookup(getattr(runtime, spec.runtime), spec.path)
    if spec.requests:
        return _number(getattr(requests, spec.requests))
    return _lookup(stats, spec.path)


class ReplicaMetrics:
    """The Prometheus series of one model's replica. Thread-safe: `update` may be called
    from the batching thread and from request handlers."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._counters = self._make(metrics.Counter, COUNTERS)
        self._gauges = self._make(metrics.Gauge, GAUGES)
        self._request_seconds = metrics.Histogram(
            "dynvm_request_seconds", description="Inference request latency in seconds.",
            boundaries=REQUEST_SECONDS_BOUNDARIES, tag_keys=(MODEL_TAG,))
        self._request_seconds.set_default_tags({MODEL_TAG: model_name})

    def _make(self, kind, specs: tuple[Series, ...]) -> dict:
        made = {}
        for spec in specs:
            if spec.metric not in made:
                metric = kind(spec.metric, description=spec.description,
                              tag_keys=(MODEL_TAG, *spec.tags))
                metric.set_default_tags({MODEL_TAG: self.model_name})
                made[spec.metric] = metric
        return made

    def update(self, stats: Mapping) -> dict[str, float]:
        """Record `stats` (see the module docstring). Returns what was recorded:
        {Series.key: counter increase or gauge value}; unchanged counters are left out."""
        recorded: dict[str, float] = {}
        runtime = RuntimeStats.from_dict(stats)
        requests = read(RequestCounters, stats)
        with self._lock:
            for spec in COUNTERS:
                value = _value(spec, runtime, requests, stats)
                if value is None:
                    continue
                last = self._last.get(spec.key, 0)
                increase = value - last if value >= last else value  # a restart
                self._last[spec.key] = value
                if increase > 0:
                    self._counters[spec.metric].inc(increase, tags=dict(spec.tags))
                    recorded[spec.key] = increase
            for spec in GAUGES:
                value = _value(spec, runtime, requests, stats)
                if value is not None:
                    self._gauges[spec.metric].set(value, tags=dict(spec.tags))
                    recorded[spec.key] = value
        return recorded

    def observe_request(self, seconds: float) -> None:
        """One inference request's latency (for p50/p99 through histogram_quantile)."""
        self._request_seconds.observe(seconds)
