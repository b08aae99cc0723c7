"""Metrics of a generator replica: time to first token, inter-token latency, tokens/s,
sequences by how they ended, running and waiting sequences, cache occupancy and the
scheduler's cache copies.

Fed by the scheduler's thread (dynvm.cluster.serving._generate_scheduler: `token`, `ended`,
`occupancy`); read as a JSON snapshot (the replica's /stats) and as Prometheus text
(`prometheus_text`, the replica's GET /metrics), and exported through Ray's metrics API
like the inference replica's series (dynvm.cluster.serving._metrics), with the `model` tag:

    ray_dynvm_generate_ttft_seconds            histogram: arrival -> first token
    ray_dynvm_generate_itl_seconds             histogram: between a sequence's tokens
    ray_dynvm_generate_tokens_total            tokens generated
    ray_dynvm_generate_sequences_total{reason=stop|length|cancelled|error}
    ray_dynvm_generate_running                 sequences in the decode batch
    ray_dynvm_generate_waiting                 sequences admitted, not yet running
    ray_dynvm_generate_cache_occupancy         reserved cache tokens / cache_tokens
    ray_dynvm_generate_cache_copy_bytes_total  bytes the scheduler's joins and leaves copied

tokens/s is a PromQL rate of the tokens counter; the snapshot gives it over the last
RATE_WINDOW_S seconds.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from dynvm.cluster._counters import GenerationRates, as_dict

TTFT_BOUNDARIES = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0]
ITL_BOUNDARIES = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0]
RATE_WINDOW_S = 10.0
REASONS = ("stop", "length", "cancelled", "error")
_SAMPLES = 4096


def _percentile(values, q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class _Histogram:
    """Cumulative Prometheus buckets, kept here for the text exposition."""

    def __init__(self, boundaries) -> None:
        self.boundaries = boundaries
        self.counts = [0] * (len(boundaries) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, bound in enumerate(self.boundaries):
            if value <= bound:
                self.counts[i] += 1
                return
        self.counts[-1] += 1

    def lines(self, name: str, labels: str) -> list[str]:
        out, total = [], 0
        for bound, count in zip([*self.boundaries, "+Inf"], self.counts):
            total += count
            out.append(f'{name}_bucket{{{labels},le="{bound}"}} {total}')
        out += [f"{name}_sum{{{labels}}} {self.sum}", f"{name}_count{{{labels}}} {self.count}"]
        return out


class GenerateMetrics:
    """The generator replica's series (see the module docstring); thread-safe."""

    def __init__(self, model_name: str, export_to_ray: bool = True) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self._ttft = _Histogram(TTFT_BOUNDARIES)
        self._itl = _Histogram(ITL_BOUNDARIES)
        self._recent_ttft: deque[float] = deque(maxlen=_SAMPLES)
        self._recent_itl: deque[float] = deque(maxlen=_SAMPLES)
        self._token_times: deque[float] = deque(maxlen=1 << 16)
        self.tokens = 0
        self.sequences = dict.fromkeys(REASONS, 0)
        self.state: dict = {}
        self._pending: list[tuple[str, float]] = []   # samples not yet given to Ray
        self._ray = _RaySeries(model_name) if export_to_ray else None

    def token(self, seq, now: float) -> None:
        """A token of `seq` was chosen at `now` (before seq's own timestamps move)."""
        with self._lock:
            self.tokens += 1
            self._token_times.append(now)
            if seq.first_token_at is None:
                value, kind = now - seq.arrived, "ttft"
                self._ttft.observe(value)
                self._recent_ttft.append(value)
            else:
                value, kind = now - seq.last_token_at, "itl"
                self._itl.observe(value)
                self._recent_itl.append(value)
            self._pending.append((kind, value))

    def ended(self, seq, reason: str) -> None:
        """`seq` ended: stop, length, cancelled or error."""
        with self._lock:
            key = reason if reason in self.sequences else "error"
            self.sequences[key] += 1
            self._pending.append((key, 1.0))

    def occupancy(self, state: dict) -> None:
        """After a scheduler step: its occupancy (GenerateScheduler.occupancy) and the
        counters; hands what accumulated to Ray."""
        with self._lock:
            self.state = dict(state)
            pending, self._pending = self._pending, []
        if self._ray is not None:
            self._ray.export(pending, state)

    def snapshot(self) -> dict:
        """TTFT and ITL percentiles over the recent samples, tokens/s over the last
        RATE_WINDOW_S, sequences by reason, occupancy."""
        now = time.monotonic()
        with self._lock:
            recent = sum(1 for t in self._token_times if now - t <= RATE_WINDOW_S)
            ttft, itl = list(self._recent_ttft), list(self._recent_itl)
            rates = GenerationRates(
                tokens=self.tokens, tokens_per_s=recent / RATE_WINDOW_S,
                ttft_p50_s=_percentile(ttft, 0.5), ttft_p99_s=_percentile(ttft, 0.99),
                itl_p50_s=_percentile(itl, 0.5), itl_p99_s=_percentile(itl, 0.99),
                sequences=dict(self.sequences))
            return {**as_dict(rates), **self.state}

    def prometheus_text(self) -> str:
        """The series in Prometheus' text exposition format (GET /metrics)."""
        labels = f'model="{self.model_name}"'
        p = "dynvm_generate"
        with self._lock:
            state = self.state
            lines = [f"# TYPE {p}_ttft_seconds histogram",
                     *self._ttft.lines(f"{p}_ttft_seconds", labels),
                     f"# TYPE {p}_itl_seconds histogram",
                     *self._itl.lines(f"{p}_itl_seconds", labels),
                     f"# TYPE {p}_tokens_total counter",
                     f"{p}_tokens_total{{{labels}}} {self.tokens}",
                     f"# TYPE {p}_sequences_total counter",
                     *(f'{p}_sequences_total{{{labels},reason="{r}"}} {n}'
                       for r, n in self.sequences.items())]
            for key, value in _gauges(state).items():
                lines += [f"# TYPE {p}_{key} gauge", f"{p}_{key}{{{labels}}} {value}"]
            copied = state.get("copy_bytes", 0)
        lines += [f"# TYPE {p}_cache_copy_bytes_total counter",
                  f"{p}_cache_copy_bytes_total{{{labels}}} {copied}"]
        return "\n".join(lines) + "\n"


def _gauges(state: dict) -> dict:
    cache = state.get("cache_tokens") or 0
    return {"running": state.get("running", 0), "waiting": state.get("waiting", 0),
            "cache_occupancy": (state.get("reserved_tokens", 0) / cache) if cache else 0.0}


class _RaySeries:
    """The same series through Ray's metrics API (exported on each node's metrics port)."""

    def __init__(self, model_name: str) -> None:
        from ray.serve import metrics

        tags = ("model",)
        self.tags = {"model": model_name}
        self.ttft = metrics.Histogram("dynvm_generate_ttft_seconds", "Arrival to first token.",
                                      TTFT_BOUNDARIES, tag_keys=tags)
        self.itl = metrics.Histogram("dynvm_generate_itl_seconds",
                                     "Time between a sequence's tokens.", ITL_BOUNDARIES,
                                     tag_keys=tags)
        self.tokens = metrics.Counter("dynvm_generate_tokens", "Tokens generated.",
                                      tag_keys=tags)
        self.sequences = metrics.Counter("dynvm_generate_sequences",
                                         "Sequences ended, by reason.",
                                         tag_keys=("model", "reason"))
        self.gauges = {key: metrics.Gauge(f"dynvm_generate_{key}", text, tag_keys=tags)
                       for key, text in (("running", "Sequences in the decode batch."),
                                         ("waiting", "Sequences admitted, not running."),
                                         ("cache_occupancy",
                                          "Reserved cache tokens / cache_tokens."))}
        self.copies = metrics.Counter("dynvm_generate_cache_copy_bytes",
                                      "Bytes the scheduler's joins and leaves copied.",
                                      tag_keys=tags)
        self._copied = 0

    def export(self, pending: list[tuple[str, float]], state: dict) -> None:
        tokens = 0
        for kind, value in pending:
            if kind == "ttft":
                self.ttft.observe(value, self.tags)
                tokens += 1
            elif kind == "itl":
                self.itl.observe(value, self.tags)
                tokens += 1
            else:
                self.sequences.inc(1, {**self.tags, "reason": kind})
        if tokens:
            self.tokens.inc(tokens, self.tags)
        for key, value in _gauges(state).items():
            self.gauges[key].set(value, self.tags)
        copied = state.get("copy_bytes", 0)
        if copied > self._copied:
            self.copies.inc(copied - self._copied, self.tags)
            self._copied = copied
