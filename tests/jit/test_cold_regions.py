"""Note [Cold regions] and Note [Compile cost estimate]: a region whose specializations
could never pay for their compile stops being profiled (it costs the interpreter's
speed, not more), is looked at again later, and results never change; one slow first
compile does not make every later region look too expensive to compile."""

from __future__ import annotations

import random

import torch

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.jit.region_jit import COLD_CHECK_EVERY
from tests.jit._jit_helpers import compiled, demo


def test_a_region_that_cannot_pay_goes_cold_and_stays_correct():
    program = compiled("recommender")
    # A horizon of one call: no saving can ever beat a compile.
    runtime = dynvm.Runtime(program, "cpu", jit=JitConfig(horizon_calls=1))
    reference = dynvm.Runtime(program, "cpu", jit=False)
    rng = random.Random(0)
    draws = [demo("recommender").sample_inputs(rng) for _ in range(4)]
    calls = COLD_CHECK_EVERY + 8   # the check after COLD_CHECK_EVERY profiled calls, then 8 cold
    for i in range(calls):
        inputs = draws[i % len(draws)]
        torch.testing.assert_close(runtime(*inputs), reference(*inputs))
    stats = runtime.stats()
    assert stats["cold_periods"] >= 1
    assert stats["compiles"] == 0 and stats["promotions"] == 0
    # Cold with nothing installed: detached (Note [Detached regions]), so its later calls
    # are neither counted nor profiled; tests/jit/test_detach.py follows it further.
    watched = len(runtime.jit.regions)
    assert stats["detached_regions"] == watched
    assert stats["interpreted_region_calls"] == watched * COLD_CHECK_EVERY
    region_jit = next(iter(runtime.jit.regions.values()))
    profiled = region_jit.profile.calls
    runtime(*draws[0])
    assert profiled == COLD_CHECK_EVERY
    assert region_jit.profile.calls == profiled, "a cold region's call was profiled"


def test_a_region_that_can_pay_never_goes_cold():
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=JitConfig(horizon_calls=10**9,
                                                          expected_speedup=1.0))
    inputs = demo("recommender").sample_inputs(random.Random(1))
    for _ in range(COLD_CHECK_EVERY + 4):
        runtime(*inputs)
    assert runtime.stats()["cold_periods"] == 0


def test_one_slow_compile_does_not_dominate_the_cost_estimate():
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=False)
    jit = dynvm.jit.engine.Jit(program, runtime.interpreter, JitConfig())
    # seconds per instruction: one warm-up outlier, then ordinary compiles
    for rate in (0.1, 0.0004, 0.0005, 0.0003):
        jit._compile_rates.append(rate)
    estimate = jit.estimated_compile_seconds(10)
    assert estimate == jit.config.compile_seconds_base + 0.0004 * 10


def test_a_region_whose_promotions_are_decided_elsewhere_never_goes_cold():
    """With online_compile=False (a fleet's service or `dynvm precompile` decides), every
    miss must stay an observation, however small the region."""
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=JitConfig(horizon_calls=1,
                                                          online_compile=False))
    inputs = demo("recommender").sample_inputs(random.Random(2))
    for _ in range(COLD_CHECK_EVERY + 8):
        runtime(*inputs)
    assert runtime.stats()["cold_periods"] == 0
    region_jit = next(iter(runtime.jit.regions.values()))
    assert region_jit.profile.calls == COLD_CHECK_EVERY + 8
