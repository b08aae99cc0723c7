"""OpenTelemetry tracing of a Runtime: call spans, promotions, compiles, guard failures.

    telemetry, exporter = Telemetry.in_memory()      # tests
    telemetry = Telemetry.console()                  # `--trace`
    telemetry = Telemetry.from_env()                 # OTEL_* (OTLP over HTTP or gRPC)
    runtime = dynvm.Runtime(program, telemetry=telemetry)

A `Telemetry` owns its tracer; nothing here is a module-level mutable global (the global
OpenTelemetry provider is never set). A disabled `Telemetry` (the default, and what
`from_env` gives when nothing is configured) makes the Runtime skip every tracing call:
the call path checks `enabled` once and creates no span and no context.

Which OTEL_* variables turn tracing on is decided in dynvm._env, the one module that
reads the environment (Conventions 8); the exporter and the TracerProvider then read
their own OTEL_* settings (endpoint, headers, sampler, resource) as the SDK documents.

Note [Trace shape]
~~~~~~~~~~~~~~~~~~
    dynvm.call                      one per Runtime call (the request span)
      event dynvm.guard_failure     first failing check (sampled, rate limited)
      event dynvm.deopt             kernel, error (rate limited)
      dynvm.promote                 recurrence, threshold, benefit, cost, target
        dynvm.compile               on the compile thread: region, family key, backend,
                                    target, duration, kernel, source bytes, guard strength
        dynvm.install               when the kernel enters the region's slot
The promote span's context is captured on the calling thread and handed to the compile
task, so one trace id covers request -> compile -> install even when the compile runs
on a background thread long after the request returned.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from dynvm._env import trace_settings

TRACER_NAME = "dynvm"
DEFAULT_MAX_EVENTS_PER_SECOND = 50


class EventLimiter:
    """A token bucket: at most `per_second` events a second (bursts up to that many), so
    a shape storm cannot flood the exporter. Thread-safe; counts what it refused."""

    def __init__(self, per_second: float, clock=time.monotonic) -> None:
        self.per_second = per_second
        self._clock = clock
        self._tokens = float(per_second)
        self._last = clock()
        self._lock = threading.Lock()
        self.dropped = 0

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.per_second,
                               self._tokens + (now - self._last) * self.per_second)
            self._last = now
            if self._tokens >= 1.0:
                self._tokens -= 1.0
                return True
            self.dropped += 1
            return False


class Telemetry:
    """Where a Runtime's spans go. `provider=None`: disabled (a no-op tracer)."""

    def __init__(self, provider: TracerProvider | None = None,
                 max_events_per_second: float = DEFAULT_MAX_EVENTS_PER_SECOND) -> None:
        self.provider = provider
        self.enabled = provider is not None
        self.tracer = (provider.get_tracer(TRACER_NAME) if provider is not None
                       else trace.NoOpTracer())
        self.max_events_per_second = max_events_per_second

    # -- constructors ------------------------------------------------------------------

    @classmethod
    def disabled(cls) -> Telemetry:
        return cls(None)

    @classmethod
    def in_memory(cls, max_events_per_second: float = DEFAULT_MAX_EVENTS_PER_SECOND
                  ) -> tuple[Telemetry, InMemorySpanExporter]:
        """Telemetry exporting synchronously into an InMemorySpanExporter (tests)."""
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider, max_events_per_second), exporter

    @classmethod
    def console(cls, out=None) -> Telemetry:
        """Spans printed as JSON when they end (the CLI's --trace)."""
        provider = TracerProvider()
        exporter = ConsoleSpanExporter() if out is None else ConsoleSpanExporter(out=out)
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Telemetry:
        """Enabled only when OTEL_TRACES_EXPORTER or an OTLP endpoint is set (and the SDK
        is not disabled): `dynvm._env.trace_settings` reads them, from `environ` or the
        process environment. An exporter whose package is not installed gives a warning
        and is skipped, never an error; with none left, Telemetry is disabled."""
        exporters = []
        for choice in trace_settings(environ).exporters:
            exporter_class = _load_exporter(choice.entry_point)
            if exporter_class is None:
                warnings.warn(f"dynvm telemetry: OTEL_TRACES_EXPORTER {choice.name!r} needs "
                              f"the exporter entry point {choice.entry_point!r}, which is "
                              f"not installed (pip install opentelemetry-exporter-otlp); "
                              f"tracing is off", RuntimeWarning, stacklevel=2)
                continue
            exporters.append(exporter_class())
        if not exporters:
            return cls.disabled()
        provider = TracerProvider()  # reads OTEL_TRACES_SAMPLER, OTEL_RESOURCE_ATTRIBUTES
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    # -- use ---------------------------------------------------------------------------

    def event_limiter(self) -> EventLimiter:
        """A fresh limiter (one per runtime) for guard-failure and deopt events."""
        return EventLimiter(self.max_events_per_second)

    def shutdown(self) -> None:
        """Flush and stop the exporters."""
        if self.provider is not None:
            self.provider.shutdown()


def _load_exporter(name: str):
    from opentelemetry.util._importlib_metadata import entry_points

    for entry in entry_points(group="opentelemetry_traces_exporter", name=name):
        try:
            return entry.load()
        except Exception:  # a broken optional package must not break the runtime
            return None
    return None
