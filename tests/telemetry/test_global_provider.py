"""A Runtime with no Telemetry reports to the application's global TracerProvider
(Note [Global tracer provider] in dynvm.telemetry).

OpenTelemetry lets a process set its global provider once, so every scenario that sets
it runs in a child process: the test process itself never sets one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import timeit

import pytest
import torch

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.telemetry import GlobalProviderWatch, Telemetry
from tests.vm._programs import build

# Two tensor ops make a region the JIT watches; K=2 so that a call made before the
# provider is set and one made after it together promote (the late scenario).
PROGRAM = """
    0  %1 = RELU %0
    1  %2 = NEG %1
    2  RETURN {%2}
"""
JIT = {"sync": True, "min_recurrence": 2, "max_recurrence": 2, "expected_speedup": 1.0,
       "horizon_calls": 10**9, "instructions_per_recurrence_step": 10**6}

CHILD = textwrap.dedent("""
    import json, sys, time
    import torch
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    import dynvm
    from dynvm.jit.config import JitConfig
    from dynvm.telemetry import Telemetry

    program, config = dynvm.load(sys.argv[1]), JitConfig(**json.loads(sys.argv[2]))
    late = sys.argv[3] == "late"
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    report = {}
    x = torch.randn(4)

    def names():
        return sorted(span.name for span in exporter.get_finished_spans())

    if late:
        runtime = dynvm.Runtime(program, jit=config)   # before the application's set-up
        runtime(x)
        trace.set_tracer_provider(provider)
        time.sleep(1.2)                                 # past the watch's interval
        report["before"] = names()
        runtime(x)
        report["after"] = names()
    else:
        trace.set_tracer_provider(provider)
        runtime = dynvm.Runtime(program, jit=config)
        runtime(x)
        runtime(x)
        report["spans"] = names()
        exporter.clear()
        off = dynvm.Runtime(program, jit=config, telemetry=Telemetry.disabled())
        off(x)
        off(x)
        report["disabled"] = names()
        Telemetry.from_global().shutdown()
        runtime(torch.randn(5))
        report["after_shutdown"] = names()
    print(json.dumps(report))
""")


def run_child(tmp_path, mode: str) -> dict:
    path = tmp_path / "relu_neg.dvm"
    dynvm.save(build(PROGRAM, regs=3), path)
    done = subprocess.run([sys.executable, "-c", CHILD, str(path), json.dumps(JIT), mode],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def early(tmp_path_factory) -> dict:
    return run_child(tmp_path_factory.mktemp("early"), "early")


def test_spans_reach_the_global_provider_without_dynvm_setup(early):
    spans = early["spans"]
    assert spans.count("dynvm.call") == 2
    # The JIT's spans follow the same provider: the second call promoted and compiled.
    assert {"dynvm.promote", "dynvm.compile", "dynvm.install"} <= set(spans)


def test_an_explicit_disabled_telemetry_overrides_the_global_provider(early):
    assert early["disabled"] == []


def test_shutdown_leaves_the_applications_provider_running(early):
    assert early["after_shutdown"] == ["dynvm.call"]


def test_a_provider_set_after_the_runtime_is_followed(tmp_path):
    report = run_child(tmp_path, "late")
    assert report["before"] == []
    assert report["after"].count("dynvm.call") == 1
    assert {"dynvm.promote", "dynvm.compile", "dynvm.install"} <= set(report["after"])


def test_without_a_global_provider_a_runtime_does_no_tracing_work():
    runtime = dynvm.Runtime(build(PROGRAM, regs=3), jit=JitConfig(**JIT))
    assert runtime.telemetry is None and runtime.jit.tracing is None
    runtime(torch.randn(4))
    assert runtime.telemetry is None   # still the no-op proxy: nothing was made


def test_a_watch_dropped_by_another_thread_is_no_error():
    # Thread A saw the watch, thread B adopted the provider and dropped it, then A asks.
    runtime = dynvm.Runtime(build(PROGRAM, regs=3), jit=False)
    runtime._global_watch = None
    assert runtime._follow_global() is False
    runtime.telemetry = Telemetry.disabled()
    assert runtime._follow_global() is True


def test_the_watch_looks_once_per_interval(monkeypatch):
    now = [0.0]
    watch = GlobalProviderWatch(interval_s=1.0, clock=lambda: now[0])
    looks = []
    monkeypatch.setattr(Telemetry, "from_global",
                        classmethod(lambda cls: looks.append(now[0])))
    for step in range(25):
        now[0] = step * 0.1
        assert watch.check() is None
    assert looks == [1.0, 2.0]


def test_the_watch_costs_little_per_call():
    # Not a benchmark: a guard that the per-call check stays a clock read and a compare
    # (the API's get_tracer_provider() costs ~1.6 us; a proxy span ~10 us).
    watch = GlobalProviderWatch()
    seconds = min(timeit.repeat(watch.check, number=20_000, repeat=5)) / 20_000
    assert seconds < 2e-6, f"{seconds * 1e9:.0f} ns per check"
