"""Promotion, tier 2 and the cold check price a key by one stall-capped mean (Note
[Stall-capped mean] in dynvm.jit.profiler): one preempted call does not promote a
signature that would not promote without it, and a signature slow on every call still
does. Real programs and real regions; the calls' times are fed to the region's own
profiling (its `_observe`, what `leave` runs), so no compile is queued for them."""

from __future__ import annotations

import pytest

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.jit.guards import GuardStrength
from dynvm.jit.policy import EXACT
from dynvm.jit.profiler import STALL_CAP, RegionProfile, stall_capped_mean
from dynvm.jit.region_slot import Specialization
from dynvm.jit.tiering import exact_benefit
from tests.jit._jit_helpers import compiled
from tests.jit.test_families_arenas import (
    family_config,
    one_thread,  # noqa: F401 — the autouse fixture of that module, here too
    region,
    small,  # noqa: F401 — the module-scoped program fixture
    x_of,
)

STALL = 100.0   # one call this many times the others: a preempted call on a loaded host
K = 4


def test_the_capped_mean_is_the_mean_until_a_call_passes_the_cap():
    assert stall_capped_mean(3.0, 3, 1.0) == pytest.approx(1.0)
    assert stall_capped_mean(0.0, 0, float("inf")) == 0.0
    profile = RegionProfile(window=64)
    for seconds in (1.0, 1.0, 1.0, STALL):
        stats = profile.record(("sig",), seconds)
    assert stats.mean_seconds == pytest.approx((3.0 + STALL) / 4)
    assert stats.capped_mean_seconds == pytest.approx(STALL_CAP * 1.0)


@pytest.fixture
def region_jit():
    """A real region with K = 4, one kind of kernel (no families) and a fixed horizon
    (longer than the calls fed, so the region's age does not move it)."""
    config = JitConfig(expected_speedup=0.5, families=False, min_recurrence=K,
                       max_recurrence=K, window=64, horizon_calls=10_000,
                       compile_seconds_base=10.0)
    runtime = dynvm.Runtime(compiled("recommender"), "cpu", jit=config)
    try:
        yield next(iter(runtime.jit.regions.values()))
    finally:
        runtime.close()


def _typical_seconds(region_jit, benefit_over_cost: float) -> float:
    """The per-call time at which a key seen K times in the window has a benefit of
    `benefit_over_cost` x its compile cost (Note [Promotion] in dynvm.jit.policy)."""
    config = region_jit.engine.config
    cost = region_jit.engine.estimated_compile_seconds(len(region_jit.region), EXACT)
    speedup = region_jit.refresh_policy_inputs().speedup(EXACT)
    return benefit_over_cost * cost * config.window / (K * config.horizon_calls * speedup)


def _promotions(region_jit, times: list[float]) -> int:
    """Feed one signature's calls taking `times`; the promotions decided."""
    for seconds in times:
        region_jit._observe((("key", 0),), seconds)
    return region_jit.counters.promotions


def test_one_stall_does_not_promote_a_key_that_would_not_promote_without_it(region_jit):
    """0.2x its compile at K sightings, 0.4x at 2K: never pays, and capped at STALL_CAP
    x its fastest call it still does not (0.8x). One call 100x the rest made its
    uncapped mean 26x at K, its benefit 5x the compile."""
    typical = _typical_seconds(region_jit, 0.2)
    assert _promotions(region_jit, [typical] * (2 * K)) == 0
    region_jit.profile = RegionProfile(region_jit.profile.window)   # a fresh start
    times = [typical] * (2 * K)
    times[1] = STALL * typical
    assert _promotions(region_jit, times) == 0, region_jit.profile.table[(("key", 0),)]
    assert not region_jit.pending


def test_a_key_slow_on_every_call_still_promotes(region_jit):
    """The same key at 5x its compile on every call pays: promoted once seen K times."""
    typical = _typical_seconds(region_jit, 5.0)
    assert _promotions(region_jit, [typical] * K) == 1
    assert (("key", 0),) in region_jit.pending


def _family_kernel(region_jit, times: list[float]) -> Specialization:
    """A family kernel's record of its calls (`times`), as its hits write it."""
    spec = Specialization(signature=(("key", 0),), strength=GuardStrength.FAMILY,
                          fn=None, artifact=None)
    for seconds in times:
        spec.seconds += seconds
        spec.calls += 1
        spec.fastest_seconds = min(spec.fastest_seconds, seconds)
    return spec


def test_tier_two_prices_a_family_kernel_by_its_capped_mean(region_jit):
    """Note [Tier-2 checks]: one stalled hit of the family kernel no longer multiplies
    the exact kernel's benefit; a kernel slow on every hit keeps its full benefit."""
    steady = _family_kernel(region_jit, [1e-3] * 8)
    stalled = _family_kernel(region_jit, [1e-3] * 7 + [STALL * 1e-3])
    slow = _family_kernel(region_jit, [STALL * 1e-3] * 8)
    benefit_steady, cost = exact_benefit(region_jit, 8, steady)
    benefit_stalled, _ = exact_benefit(region_jit, 8, stalled)
    benefit_slow, _ = exact_benefit(region_jit, 8, slow)
    assert benefit_stalled <= STALL_CAP * benefit_steady * (1 + 1e-9)
    assert benefit_slow == pytest.approx(STALL * benefit_steady)
    assert cost > 0


def test_a_hit_records_its_kernels_fastest_call(small):  # noqa: F811
    """The kernel's fastest call, which tier 2's cap reads, is written by its hits."""
    _, program, _ = small
    runtime = dynvm.Runtime(program, jit=family_config())
    try:
        for b in (20, 30, 40, 25, 25, 25):
            runtime(x_of(b))
        kernels = [s for s in region(runtime).installed() if s.calls]
        assert kernels
        for spec in kernels:
            assert 0 < spec.fastest_seconds <= spec.seconds / spec.calls
    finally:
        runtime.close()
