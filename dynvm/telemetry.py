"""OpenTelemetry tracing of a Runtime: call spans, promotions, compiles, guard failures.

    telemetry, exporter = Telemetry.in_memory()      # tests
    telemetry = Telemetry.console()                  # `--trace`
    telemetry = Telemetry.from_env()                 # OTEL_* (OTLP over HTTP or gRPC)
    runtime = dynvm.Runtime(program, telemetry=telemetry)

A `Telemetry` owns its tracer; nothing here is a module-level mutable global and nothing
here sets the global OpenTelemetry provider. A Runtime given no `Telemetry` follows the
application's global provider (Note [Global tracer provider]); a disabled `Telemetry`
(what `from_env` gives when nothing is configured) makes the Runtime skip every tracing
call: the call path checks once and creates no span and no context.

This module is a leaf (docs/ARCHITECTURE.md, Layout): it imports nothing above dynvm.vm, and the
OpenTelemetry SDK only inside the constructors that build an SDK provider, so importing
it (and every layer that does) costs the OpenTelemetry API alone.

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

Note [Global tracer provider]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
OpenTelemetry's library convention (docs/ARCHITECTURE.md, Conventions 12): an application that
configures tracing the standard way (`trace.set_tracer_provider(...)`, or the
`opentelemetry-instrument` launcher) expects every instrumented library to report to
that provider with no set-up of its own. So a Runtime with `telemetry=None` traces into
the global provider once one is set, and does no tracing work while it is still the
API's no-op proxy: the JIT checks `telemetry is None` on the call path, so a
`Telemetry` is only made when spans would be recorded (going through the proxy tracer
instead would cost ~10 us a call in spans that record nothing).

The global provider can be set only once per process, but possibly after a Runtime was
made. `GlobalProviderWatch` looks at it when the Runtime is made and then at most once
every `interval_s` from the call path (a clock read and a compare; the API's own
`get_tracer_provider()` looks up an environment variable, ~1.6 us, too dear for every
call); when it finds one set, the Runtime starts tracing and stops looking. An explicit
`Telemetry` (enabled or not) overrides the global provider; `shutdown()` never shuts
down a provider the application owns.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING

from opentelemetry import trace

from dynvm._env import trace_settings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

TRACER_NAME = "dynvm"
DEFAULT_MAX_EVENTS_PER_SECOND = 50
# How often a Runtime without a Telemetry looks for a newly set global provider
# (Note [Global tracer provider]).
GLOBAL_PROVIDER_CHECK_S = 1.0


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
    """Where a Runtime's spans go. `provider=None`: disabled (a no-op tracer).

    `owns_provider=False` for a provider someone else manages (the application's global
    one): `shutdown()` then leaves it running."""

    def __init__(self, provider: trace.TracerProvider | None = None,
                 max_events_per_second: float = DEFAULT_MAX_EVENTS_PER_SECOND,
                 owns_provider: bool = True) -> None:
        self.provider = provider
        self.enabled = provider is not None
        self.tracer = (provider.get_tracer(TRACER_NAME) if provider is not None
                       else trace.NoOpTracer())
        self.max_events_per_second = max_events_per_second
        self.owns_provider = owns_provider

    # -- constructors ------------------------------------------------------------------

    @classmethod
    def disabled(cls) -> Telemetry:
        """Tracing off, overriding any global provider (no span, no context, no cost)."""
        return cls(None)

    @classmethod
    def from_global(cls) -> Telemetry | None:
        """The application's global TracerProvider, or None while it is unset (the API's
        no-op proxy): Note [Global tracer provider]."""
        provider = trace.get_tracer_provider()
        if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
            return None
        return cls(provider, owns_provider=False)

    @classmethod
    def in_memory(cls, max_events_per_second: float = DEFAULT_MAX_EVENTS_PER_SECOND
                  ) -> tuple[Telemetry, InMemorySpanExporter]:
        """Telemetry exporting synchronously into an InMemorySpanExporter (tests)."""
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider, max_events_per_second), exporter

    @classmethod
    def console(cls, out=None) -> Telemetry:
        """Spans printed as JSON when they end (the CLI's --trace)."""
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

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
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        provider = TracerProvider()  # reads OTEL_TRACES_SAMPLER, OTEL_RESOURCE_ATTRIBUTES
        for exporter in exporters:
            provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    # -- use ---------------------------------------------------------------------------

    def event_limiter(self) -> EventLimiter:
        """A fresh limiter (one per runtime) for guard-failure and deopt events."""
        return EventLimiter(self.max_events_per_second)

    def shutdown(self) -> None:
        """Flush and stop the exporters (not those of a provider it does not own)."""
        if self.provider is not None and self.owns_provider:
            self.provider.shutdown()


class GlobalProviderWatch:
    """Finds the moment the application sets its global TracerProvider, cheaply enough
    for every call (Note [Global tracer provider]). Thread-safe: at worst two threads
    both look and both build a Telemetry for the same provider."""

    def __init__(self, interval_s: float = GLOBAL_PROVIDER_CHECK_S,
                 clock=time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._next = clock() + interval_s

    def check(self) -> Telemetry | None:
        """None until the global provider is set (looked at once per interval); then a
        Telemetry for it."""
        now = self._clock()
        if now < self._next:
            return None
        self._next = now + self.interval_s
        return Telemetry.from_global()


def _load_exporter(name: str):
    from opentelemetry.util._importlib_metadata import entry_points

    for entry in entry_points(group="opentelemetry_traces_exporter", name=name):
        try:
            return entry.load()
        except Exception:  # a broken optional package must not break the runtime
            return None
    return None
