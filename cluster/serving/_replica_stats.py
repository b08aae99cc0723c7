"""A replica's counters, latency window and Prometheus refresh, off the request path
(Note [Lean request path] in dynvm.cluster.serving._replica).

`ReplicaStats.snapshot()` is the one place the serving layer reads `Runtime.stats()`;
the `/stats` route, the Prometheus refresh and `dynvm top` all see what it builds. The
refresh runs on its own daemon thread, at most once every METRICS_EVERY_S and only after
requests came: an idle replica does no work for it, and no request handler ever walks
the runtime's regions.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque

from ray import serve

from dynvm.cluster._counters import RequestCounters, as_dict
from dynvm.cluster.serving._metrics import ReplicaMetrics

logger = logging.getLogger("dynvm.cluster.serving._replica")

LATENCY_WINDOW = 1024      # recent requests whose latency stats() summarizes
METRICS_EVERY_S = 1.0      # Prometheus series are refreshed at most this often
_PENDING_LIMIT = 65536     # latencies kept for the histogram while the refresh lags


def _replica_tag() -> str | None:
    """Serve's id of this replica (the Prometheus `replica` tag), None outside Serve."""
    try:
        return serve.get_replica_context().replica_tag
    except Exception:  # not running inside a Serve replica (a direct test)
        return None


def _rss_bytes() -> int | None:
    """This process's resident memory (Linux /proc), None where there is none."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _percentiles_ms(seconds: list[float]) -> dict:
    if not seconds:
        return {"p50": None, "p99": None, "count": 0}
    ordered = sorted(seconds)

    def at(q: float) -> float:
        return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"p50": at(0.50), "p99": at(0.99), "count": len(ordered)}


class ReplicaStats:
    """The request counters (bumped on the event loop only), the latency window and
    the Prometheus refresh of one replica (module docstring)."""

    def __init__(self, model_name: str, runtime, executor, link) -> None:
        self.model_name = model_name
        self._runtime = runtime
        self._executor = executor
        self._link = link
        self.counters = RequestCounters()
        self.in_flight = 0
        self._latencies: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._unobserved: list[float] = []   # for the histogram, at the next refresh
        self._replica = _replica_tag()
        self.metrics = ReplicaMetrics(model_name)
        self._stop = threading.Event()
        self._refresher = threading.Thread(target=self._refresh_loop, daemon=True,
                                           name="dynvm-metrics")
        self._refresher.start()

    @contextlib.contextmanager
    def tracked(self):
        """Around one inference request of any transport: counted in flight and in
        `requests`, its latency observed when it ends."""
        self.in_flight += 1
        self.counters.requests += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self.in_flight -= 1
            self.observe(time.perf_counter() - start)

    def observe(self, seconds: float) -> None:
        """One finished request (on the event loop: two appends, nothing else)."""
        self._latencies.append(seconds)
        if len(self._unobserved) < _PENDING_LIMIT:
            self._unobserved.append(seconds)

    def snapshot(self) -> dict:
        """The replica's stats: the runtime's, the request and batch counters, latency
        percentiles, the fleet's; what `/stats` answers and Prometheus exports."""
        stats = {"model": self.model_name, "replica": self._replica,
                 **self._runtime.stats().to_dict(), **as_dict(self._executor.counters),
                 **as_dict(self.counters),
                 "in_flight": self.in_flight,
                 "batching": self._executor.batcher.stats(),
                 "latency_ms": _percentiles_ms(list(self._latencies)),
                 "process": {"pid": os.getpid(), "rss_bytes": _rss_bytes()}}
        if self._link is not None:
            stats["fleet"] = self._link.stats()
            stats["store"] = stats["fleet"]["store"]
        return stats

    def refresh(self) -> None:
        """Push the new latencies and the current stats to Prometheus."""
        latencies, self._unobserved = self._unobserved, []
        for seconds in latencies:
            self.metrics.observe_request(seconds)
        self.metrics.update(self.snapshot())

    def _refresh_loop(self) -> None:
        seen = -1
        failures = 0
        while not self._stop.wait(METRICS_EVERY_S):
            requests = self.counters.requests
            if requests == seen:
                continue   # idle: nothing new to export
            try:
                self.refresh()
                seen = requests
            except Exception:  # e.g. a dict that changed size under a concurrent batch
                failures += 1
                if failures == 1:
                    logger.warning("model %r: metrics refresh failed (retried next tick)",
                                   self.model_name, exc_info=True)

    def close(self) -> None:
        """Stop the refresh thread (after its current tick)."""
        self._stop.set()
