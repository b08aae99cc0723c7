"""Tracing with the in-memory exporter (Note [Trace shape] in dynvm.telemetry)."""

from __future__ import annotations

import io

import pytest
import torch

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.telemetry import EventLimiter, Telemetry
from tests.jit._jit_helpers import SMALL_TRANSFORMER, compiled, wait_drained

PROMOTE_AT_ONCE = {"min_recurrence": 1, "max_recurrence": 1, "expected_speedup": 1.0,
                   "horizon_calls": 10**9, "instructions_per_recurrence_step": 10**6}


def x(batch: int, seq: int = 8) -> torch.Tensor:
    return torch.randn(batch, seq, SMALL_TRANSFORMER["hidden"],
                       generator=torch.Generator().manual_seed(batch))


def by_name(spans, name):
    return [s for s in spans if s.name == name]


def runtime(config: JitConfig, telemetry) -> dynvm.Runtime:
    return dynvm.Runtime(compiled("transformer"), jit=config, telemetry=telemetry)


def test_promoting_call_links_call_compile_install_in_one_trace():
    telemetry, exporter = Telemetry.in_memory()
    with runtime(JitConfig(sync=True, **PROMOTE_AT_ONCE), telemetry) as rt:
        rt(x(2))
    spans = exporter.get_finished_spans()
    (call,) = by_name(spans, "dynvm.call")
    promotes, compiles = by_name(spans, "dynvm.promote"), by_name(spans, "dynvm.compile")
    installs = by_name(spans, "dynvm.install")
    assert compiles and len(compiles) == len(promotes) == len(installs) == rt.stats()["compiles"]
    trace_id = call.context.trace_id
    assert {s.context.trace_id for s in spans} == {trace_id}
    ids = {s.context.span_id: s for s in spans}
    for promote in promotes:
        assert promote.parent.span_id == call.context.span_id
        assert promote.attributes["dynvm.recurrence"] >= promote.attributes["dynvm.threshold"]
        assert promote.attributes["dynvm.benefit_seconds"] > \
            promote.attributes["dynvm.cost_seconds"]
        assert "(2, 8, 64) float32" in promote.attributes["dynvm.specializes"]
    for span in compiles + installs:
        assert ids[span.parent.span_id].name == "dynvm.promote"
    compile_span = compiles[0]
    attrs = compile_span.attributes
    assert attrs["dynvm.backend"] == "cpu" and attrs["dynvm.target"] == "cpu"
    assert attrs["dynvm.program_hash"] == rt.program.content_hash[:12]
    assert attrs["dynvm.region"] in rt.jit.regions
    assert attrs["dynvm.kernel_count"] == 1 and attrs["dynvm.source_bytes"] > 0
    assert attrs["dynvm.duration_seconds"] > 0 and attrs["dynvm.kernel"]
    assert attrs["dynvm.guard_strength"] in ("strong", "weak", "family")
    assert "dynvm.family_key" in attrs and "dynvm.thread" in attrs


def test_async_compile_span_keeps_the_promoting_calls_trace():
    telemetry, exporter = Telemetry.in_memory()
    with runtime(JitConfig(sync=False, **PROMOTE_AT_ONCE), telemetry) as rt:
        rt(x(3))
        wait_drained(rt)
        assert rt.stats()["compiles"] > 0
    spans = exporter.get_finished_spans()
    (call,) = by_name(spans, "dynvm.call")
    compiles = by_name(spans, "dynvm.compile")
    assert compiles
    for span in compiles:
        assert span.context.trace_id == call.context.trace_id
        assert span.attributes["dynvm.thread"] == "dynvm-compile"
    assert {s.context.trace_id for s in by_name(spans, "dynvm.install")} == \
        {call.context.trace_id}


def test_guard_failure_event_names_first_failing_check():
    telemetry, exporter = Telemetry.in_memory()
    config = JitConfig(sync=True, guard_failure_sample_rate=1, families=False,
                       **PROMOTE_AT_ONCE)
    with runtime(config, telemetry) as rt:
        rt(x(2))
        exporter.clear()
        rt(x(5))
    (call,) = by_name(exporter.get_finished_spans(), "dynvm.call")
    events = [e for e in call.events if e.name == "dynvm.guard_failure"]
    assert events
    check = events[0].attributes["dynvm.first_failing_check"]
    assert "expected" in check and "got" in check and "5" in check
    assert events[0].attributes["dynvm.sample_rate"] == 1
    assert any(line.endswith(check) for line in rt.jit.event_log)


def test_rate_limit_caps_events_in_a_shape_storm():
    telemetry, exporter = Telemetry.in_memory(max_events_per_second=3)
    # The storm's limiter reads a clock that stands still: its burst of 3 is all that may
    # pass, however long the 20 calls take on a loaded host (with the real clock a slow
    # storm refilled it; the refill has its own test below).
    telemetry.event_limiter = lambda: EventLimiter(3, clock=lambda: 0.0)
    config = JitConfig(sync=True, guard_failure_sample_rate=1, families=False,
                       **PROMOTE_AT_ONCE)
    with runtime(config, telemetry) as rt:
        rt(x(2))
        for region_jit in rt.jit.regions.values():  # the storm compiles nothing more
            region_jit.threshold = 10**9
        for batch in range(3, 23):
            rt(x(batch))
    events = [e for s in by_name(exporter.get_finished_spans(), "dynvm.call")
              for e in s.events if e.name == "dynvm.guard_failure"]
    failures = rt.stats()["guard_failures"]
    assert failures >= 20
    assert len(events) == 3
    assert rt.stats()["telemetry_events_dropped"] == failures - len(events)


def test_event_limiter_refills_with_time():
    now = [0.0]
    limiter = EventLimiter(2, clock=lambda: now[0])
    assert [limiter.allow() for _ in range(4)] == [True, True, False, False]
    now[0] += 0.5
    assert limiter.allow() and not limiter.allow()
    assert limiter.dropped == 3


def test_disabled_telemetry_produces_no_spans(monkeypatch):
    _, exporter = Telemetry.in_memory()
    started = []
    from opentelemetry.sdk.trace import Tracer
    real = Tracer.start_span
    monkeypatch.setattr(Tracer, "start_span",
                        lambda self, *a, **k: started.append(a) or real(self, *a, **k))
    for telemetry in (None, Telemetry.disabled()):
        with runtime(JitConfig(sync=True, guard_failure_sample_rate=1, **PROMOTE_AT_ONCE),
                     telemetry) as rt:
            rt(x(2))
            rt(x(4))
            assert rt.telemetry is None and rt.jit.tracing is None
            assert "telemetry_events_dropped" not in rt.stats()
    assert started == [] and exporter.get_finished_spans() == ()


def test_from_env():
    assert not Telemetry.from_env({}).enabled
    assert not Telemetry.from_env({"OTEL_SDK_DISABLED": "true",
                                   "OTEL_TRACES_EXPORTER": "console"}).enabled
    assert Telemetry.from_env({"OTEL_TRACES_EXPORTER": "console"}).enabled
    assert not Telemetry.from_env({"OTEL_TRACES_EXPORTER": "none"}).enabled


def test_from_env_without_otlp_package_warns_and_stays_off():
    try:
        import opentelemetry.exporter.otlp  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("an OTLP exporter is installed")
    with pytest.warns(RuntimeWarning, match="otlp_proto_http"):
        telemetry = Telemetry.from_env({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://localhost:4318",
                                        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert not telemetry.enabled


def test_console_telemetry_prints_call_spans():
    out = io.StringIO()
    with runtime(JitConfig(sync=True, **PROMOTE_AT_ONCE), Telemetry.console(out=out)) as rt:
        rt(x(2))
    assert '"name": "dynvm.call"' in out.getvalue()
    assert '"name": "dynvm.compile"' in out.getvalue()
