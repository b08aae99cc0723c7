"""The JIT's OpenTelemetry spans and events (Note [Trace shape] in dynvm.telemetry).

A mixin of `Jit` (dynvm.jit.engine): a promotion is a span, its compile a child span
on whichever thread runs it (the promoting call's context travels with the task), the
install a span under the same parent; guard failures, deopts, probation verdicts and
specialize failures are events on the current call's span, within the runtime's rate
limit. None of it runs unless the runtime has an enabled Telemetry.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import TYPE_CHECKING

from opentelemetry import trace

from dynvm.jit.guards import describe
from dynvm.jit.queue import CompileTimeout
from dynvm.jit.region_slot import Specialization
from dynvm.jit.specialize import InputRejected, failure_reason
from dynvm.shape_cluster import Family

if TYPE_CHECKING:
    from dynvm.jit.region_jit import RegionJit


class JitTracing:
    """Spans and events of `Jit` (which owns `telemetry`, `event_limiter`, `program`,
    `backend`, `interpreter` and `_compile`)."""

    def trace_with(self, telemetry) -> None:
        """Start tracing into `telemetry` (enabled): the application set its global
        provider after this JIT was made (Note [Global tracer provider] in
        dynvm.telemetry). The limiter first: `telemetry` set means it is in place."""
        self.event_limiter = telemetry.event_limiter()
        self.telemetry = telemetry

    def _target_attributes(self, region_jit: RegionJit, target, key: str) -> dict:
        family = target.key if isinstance(target, Family) else None
        return {"dynvm.program": self.program.name,
                "dynvm.program_hash": self.program.content_hash[:12],
                "dynvm.region": region_jit.region.index,
                "dynvm.specializes": family or describe(target),
                "dynvm.family_key": family or "",
                "dynvm.cache_key": key}

    def _promote_span(self, region_jit: RegionJit, target, key: str, decision):
        attributes = self._target_attributes(region_jit, target, key)
        attributes.update({"dynvm.recurrence": decision.recurrence,
                           "dynvm.threshold": decision.threshold,
                           "dynvm.benefit_seconds": decision.benefit_seconds,
                           "dynvm.cost_seconds": decision.cost_seconds,
                           "dynvm.reason": decision.reason})
        span = self.telemetry.tracer.start_span("dynvm.promote", attributes=attributes)
        span.end()
        return trace.set_span_in_context(span)

    def _traced_compile(self, region_jit: RegionJit, target, key: str,
                        parent) -> Specialization:
        attributes = self._target_attributes(region_jit, target, key)
        attributes.update({"dynvm.backend": self.backend,
                           "dynvm.target": str(self.interpreter.device),
                           "dynvm.thread": threading.current_thread().name,
                           # Where it ran: a replica's own JIT, or the compile service.
                           "dynvm.host": socket.gethostname(), "dynvm.pid": os.getpid()})
        with self.telemetry.tracer.start_as_current_span(
                "dynvm.compile", context=parent, attributes=attributes) as span:
            try:
                spec = self._compile(region_jit, target, key)
            except Exception as exc:
                if not isinstance(exc, InputRejected | CompileTimeout):
                    span.add_event("dynvm.specialize_failure", {  # Note [Failure accounting]
                        "dynvm.region": region_jit.region.index,
                        "dynvm.reason": failure_reason(exc)})
                raise
            artifact = spec.artifact
            span.set_attributes({"dynvm.duration_seconds": artifact.compile_seconds,
                                 "dynvm.kernel": artifact.kernel_name,
                                 "dynvm.kernel_count": 1,
                                 "dynvm.source_bytes": len(artifact.source.encode()),
                                 "dynvm.guard_strength": spec.strength.value})
            return spec

    def _install_span(self, region_jit: RegionJit, spec: Specialization, parent) -> None:
        span = self.telemetry.tracer.start_span(
            "dynvm.install", context=parent,
            attributes={"dynvm.region": region_jit.region.index,
                        "dynvm.kernel": spec.artifact.kernel_name,
                        "dynvm.guard_strength": spec.strength.value,
                        "dynvm.thread": threading.current_thread().name})
        span.end()

    def _span_event(self, name: str, attributes: dict) -> None:
        """An event on the current (call) span, within the runtime's rate limit."""
        span = trace.get_current_span()
        if span.is_recording() and self.event_limiter.allow():
            span.add_event(name, attributes)
