"""Compiles that raise or hang (injected into the specializer): the request path is
unaffected, the signature is marked failed with backoff (never retried in a loop), the
error is traced, and a hung compile does not hold the queue (Note [Compile deadline])."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

import dynvm
import dynvm.jit.engine as engine
from dynvm.jit.config import JitConfig
from dynvm.telemetry import Telemetry
from tests.cluster._cluster_helpers import wait_until
from tests.jit._jit_helpers import compiled, demo

# Promote on sight (K=1, a horizon long enough for any region) so that faults show at once.
EAGER = {"min_recurrence": 1, "max_recurrence": 2, "instructions_per_recurrence_step": 10**6,
         "horizon_calls": 10**9, "expected_speedup": 1.0, "families": False}


def _inputs(n: int, seed: int = 0) -> list[tuple]:
    return [demo("recommender").sample_inputs(random.Random(seed + i)) for i in range(n)]




def test_a_raising_compile_is_backed_off_traced_and_harmless(monkeypatch):
    attempts = []
    real = engine.specialize

    def failing(program, region, *args, **kwargs):
        attempts.append(region.index)
        raise RuntimeError("injected compile failure")

    monkeypatch.setattr(engine, "specialize", failing)
    telemetry, spans = Telemetry.in_memory()
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=JitConfig(
        **EAGER, failed_compile_backoff_calls=1000), telemetry=telemetry)
    reference = dynvm.Runtime(program, "cpu", jit=False)
    inputs = _inputs(1)[0]
    for _ in range(200):
        torch.testing.assert_close(runtime(*inputs), reference(*inputs))
    assert wait_until(lambda: runtime.stats()["compile_failures"] >= 1) is not None
    stats = runtime.stats()
    regions = len(runtime.jit.regions)
    # One attempt per region and signature: the backoff (1000 calls) holds for 200.
    assert len(attempts) == stats["compile_failures"] <= regions
    assert stats["specialized_region_calls"] == 0
    assert any("injected compile failure" in line for line in runtime.jit.event_log)
    errors = [s for s in spans.get_finished_spans()
              if s.name == "dynvm.compile" and not s.status.is_ok]
    assert errors and any("injected compile failure" in str(e.attributes)
                          for s in errors for e in s.events)
    # The fault clears: after the backoff the same signature compiles and runs.
    monkeypatch.setattr(engine, "specialize", real)
    for _ in range(1100):
        runtime(*inputs)
    assert wait_until(lambda: runtime.stats()["compiles"] >= 1) is not None


def test_a_hung_compile_is_abandoned_and_the_queue_goes_on(monkeypatch):
    release = threading.Event()
    hung = []
    real = engine.specialize

    def hanging(program, region, live_in, *rest, **kwargs):
        if not hung:  # the first compile of the runtime hangs until released
            hung.append(region.index)
            release.wait(60)
        return real(program, region, live_in, *rest, **kwargs)

    monkeypatch.setattr(engine, "specialize", hanging)
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=JitConfig(**EAGER, compile_timeout_s=0.5))
    reference = dynvm.Runtime(program, "cpu", jit=False)
    try:
        draws = _inputs(6)
        slowest = 0.0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and runtime.stats()["compiles"] == 0:
            for inputs in draws:
                start = time.perf_counter()
                got = runtime(*inputs)
                slowest = max(slowest, time.perf_counter() - start)
                torch.testing.assert_close(got, reference(*inputs))
            time.sleep(0.05)
        stats = runtime.stats()
        assert hung, "the injected hang never ran"
        assert stats["compile_timeouts"] >= 1
        assert stats["compiles"] >= 1, "the queue stayed stuck behind the hung compile"
        assert slowest < 0.5, f"a call waited {slowest:.2f} s for the hung compile"
    finally:
        release.set()
        runtime.close()


@pytest.mark.parametrize("bad", [0, -1.0])
def test_compile_timeout_must_be_positive(bad):
    with pytest.raises(ValueError, match="compile_timeout_s"):
        JitConfig(compile_timeout_s=bad)
