"""The JIT's OpenTelemetry spans and events (Note [Trace shape] in dynvm.telemetry).

`JitTracing` is an object the `Jit` (dynvm.jit.engine) holds while tracing is on, and
None otherwise, so that none of this runs without an enabled Telemetry. A promotion is a
span, its compile a child span on whichever thread runs it (the promoting call's context
travels with the task), the install a span under the same parent; guard failures,
deopts, probation verdicts and specialize failures are events on the current call's
span, within the runtime's rate limit.

Its interface: it is given, once, what it names in spans (the program's name and hash,
the backend and the device) and reads nothing else of the JIT. It offers
`promote_span`, `traced_compile` (which runs the compile it is handed), `install_span`
and `event`; each takes the region's index and the target or specialization at hand.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

from opentelemetry import trace

from dynvm.jit.guards import describe
from dynvm.jit.queue import CompileTimeout
from dynvm.jit.region_slot import Specialization
from dynvm.jit.specialize import InputRejected, failure_reason
from dynvm.shape_cluster import Family


class JitTracing:
    """Spans and events of one `Jit` into `telemetry` (enabled), within its event
    limiter; built when tracing starts (the Jit's constructor or `Jit.trace_with`)."""

    def __init__(self, telemetry, program, backend: str, device) -> None:
        self.telemetry = telemetry
        self.event_limiter = telemetry.event_limiter()
        self._program_name = program.name
        self._program_hash = program.content_hash[:12]
        self._backend = backend
        self._target = str(device)

    def _target_attributes(self, region: int, target, key: str) -> dict:
        family = target.key if isinstance(target, Family) else None
        return {"dynvm.program": self._program_name,
                "dynvm.program_hash": self._program_hash,
                "dynvm.region": region,
                "dynvm.specializes": family or describe(target),
                "dynvm.family_key": family or "",
                "dynvm.cache_key": key}

    def promote_span(self, region: int, target, key: str, decision):
        """A finished `dynvm.promote` span for region `region`'s promotion of `target`;
        returns the context its compile and install spans are children of."""
        attributes = self._target_attributes(region, target, key)
        attributes.update({"dynvm.recurrence": decision.recurrence,
                           "dynvm.threshold": decision.threshold,
                           "dynvm.benefit_seconds": decision.benefit_seconds,
                           "dynvm.cost_seconds": decision.cost_seconds,
                           "dynvm.reason": decision.reason})
        span = self.telemetry.tracer.start_span("dynvm.promote", attributes=attributes)
        span.end()
        return trace.set_span_in_context(span)

    def traced_compile(self, compile_fn: Callable[[], Specialization], region: int,
                       target, key: str, parent) -> Specialization:
        """Run `compile_fn` (the compile of `target` in region `region`) inside a
        `dynvm.compile` span under `parent`; a failure that is a dynvm bug is an event
        on it (Note [Failure accounting] in dynvm.jit.engine)."""
        attributes = self._target_attributes(region, target, key)
        attributes.update({"dynvm.backend": self._backend,
                           "dynvm.target": self._target,
                           "dynvm.thread": threading.current_thread().name,
                           # Where it ran: a replica's own JIT, or the compile service.
                           "dynvm.host": socket.gethostname(), "dynvm.pid": os.getpid()})
        with self.telemetry.tracer.start_as_current_span(
                "dynvm.compile", context=parent, attributes=attributes) as span:
            try:
                spec = compile_fn()
            except Exception as exc:
                if not isinstance(exc, InputRejected | CompileTimeout):
                    span.add_event("dynvm.specialize_failure", {  # Note [Failure accounting]
                        "dynvm.region": region,
                        "dynvm.reason": failure_reason(exc)})
                raise
            artifact = spec.artifact
            span.set_attributes({"dynvm.duration_seconds": artifact.compile_seconds,
                                 "dynvm.kernel": artifact.kernel_name,
                                 "dynvm.kernel_count": 1,
                                 "dynvm.source_bytes": len(artifact.source.encode()),
                                 "dynvm.guard_strength": spec.strength.value})
            return spec

    def install_span(self, region: int, spec: Specialization, parent) -> None:
        """A finished `dynvm.install` span under `parent` for `spec` in region `region`."""
        span = self.telemetry.tracer.start_span(
            "dynvm.install", context=parent,
            attributes={"dynvm.region": region,
                        "dynvm.kernel": spec.artifact.kernel_name,
                        "dynvm.guard_strength": spec.strength.value,
                        "dynvm.thread": threading.current_thread().name})
        span.end()

    def event(self, name: str, attributes: dict) -> None:
        """An event on the current (call) span, within the runtime's rate limit."""
        span = trace.get_current_span()
        if span.is_recording() and self.event_limiter.allow():
            span.add_event(name, attributes)
