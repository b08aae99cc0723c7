"""Promotion policy (Note [Promotion]), the shape profile, the per-region LRU, and the
JIT's counters: promotion needs recurrence AND benefit, the window counts are exact and
the table bounded, shape jitter causes no compile storm.
"""

from __future__ import annotations

import importlib
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.jit.policy import decide, horizon, recurrence_threshold
from dynvm.jit.profiler import RegionProfile

h = importlib.import_module("tests.jit._jit_helpers")

FAST = settings(deadline=None, derandomize=True, database=None, max_examples=60)


def recommender_inputs(b: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    sparse = tuple(torch.randint(0, rows, (b, bag), generator=gen)
                   for rows, bag in ((1000, 3), (800, 5), (1200, 1), (500, 4)))
    return (torch.randn(b, 13, generator=gen), *sparse)


# ---------------------------------------------------------------- policy ---------------


def test_recurrence_threshold_grows_with_region_size_between_min_and_max():
    config = JitConfig()  # K from 2 to 8, one more per 24 instructions
    assert recurrence_threshold(config, 0) == 2
    assert recurrence_threshold(config, 23) == 2
    assert recurrence_threshold(config, 24) == 3
    assert recurrence_threshold(config, 100) == 6
    assert recurrence_threshold(config, 144) == 8
    assert recurrence_threshold(config, 10**6) == 8
    sizes = range(0, 400)
    ks = [recurrence_threshold(config, n) for n in sizes]
    assert ks == sorted(ks)
    assert set(ks) == set(range(2, 9))


@FAST
@given(st.integers(1, 6), st.integers(0, 10), st.integers(1, 50), st.integers(0, 2000))
def test_recurrence_threshold_is_monotone_and_clamped(low, extra, step, size):
    config = JitConfig(min_recurrence=low, max_recurrence=low + extra,
                       instructions_per_recurrence_step=step, window=64)
    k = recurrence_threshold(config, size)
    assert low <= k <= low + extra
    assert recurrence_threshold(config, size + 1) >= k


@FAST
@given(recurrence=st.integers(0, 64), threshold=st.integers(1, 8),
       mean=st.floats(0, 1e-1), speedup=st.floats(0, 1), cost=st.floats(0, 1))
def test_decide_promotes_only_with_recurrence_and_benefit(recurrence, threshold, mean,
                                                          speedup, cost):
    config = JitConfig()
    decision = decide(config, recurrence, threshold, mean, speedup, cost)
    benefit = recurrence / config.window * config.horizon_calls * mean * speedup
    assert decision.benefit_seconds == pytest.approx(benefit)
    assert decision.cost_seconds == cost
    assert decision.promote == (recurrence >= threshold and benefit > cost)
    assert decision.reason.startswith("promote" if decision.promote else "wait")


def test_decide_examples():
    config = JitConfig()  # W=64, horizon 1000
    # Seen often enough, 1 ms a call, 15% saved: 2/64 * 1000 * 1e-3 * 0.15 = 4.7 ms.
    assert decide(config, 2, 2, 1e-3, 0.15, 0.004).promote
    assert not decide(config, 2, 2, 1e-3, 0.15, 0.005).promote    # costs more
    assert not decide(config, 1, 2, 1.0, 0.15, 0.0).promote        # not seen enough


# ---------------------------------------------------------------- profile --------------


@FAST
@given(st.integers(1, 12), st.lists(st.integers(0, 20), max_size=200))
def test_window_counts_are_exact(window, sequence):
    profile = RegionProfile(window)
    for step, value in enumerate(sequence):
        profile.record((value,), 0.001)
        recent = Counter(sequence[max(0, step + 1 - window): step + 1])
        for candidate in range(21):
            assert profile.recurrence((candidate,)) == recent[candidate]
        assert len(profile.table) <= 4 * window
        # Whatever is in the window still has its stats (promotion needs them).
        for signature in recent:
            assert (signature,) in profile.table
    assert profile.calls == len(sequence)
    totals = Counter(sequence)
    forgot = len(totals) > 4 * window   # only then may old signatures have been dropped
    for (value,), stats in profile.table.items():
        assert stats.count <= totals[value]
        if not forgot:
            assert stats.count == totals[value]
            assert stats.total_seconds == pytest.approx(0.001 * totals[value])


def test_table_stays_bounded_under_a_storm_of_unique_signatures():
    window = 16
    profile = RegionProfile(window)
    largest = 0
    for i in range(20_000):
        profile.record((i,), 1e-4)
        largest = max(largest, len(profile.table))
    assert largest <= 4 * window
    assert all(profile.recurrence((i,)) == 1 for i in range(20_000 - window, 20_000))
    assert profile.recurrence((0,)) == 0
    assert sum(profile._in_window.values()) == window
    # A storm mixed with a hot signature: the hot one keeps its whole history.
    for i in range(2_000):
        profile.record(("hot",) if i % 2 else (-i,), 1e-4)
        assert len(profile.table) <= 4 * window
    assert profile.table[("hot",)].count == 1_000
    assert profile.recurrence(("hot",)) == window // 2


# ---------------------------------------------------------------- LRU ------------------


def test_lru_keeps_the_most_recently_used_specializations():
    program = h.compiled("recommender")
    interp = dynvm.Runtime(program, jit=False)
    config = h.eager_config(max_specializations_per_region=3)
    with dynvm.Runtime(program, jit=config) as rt:
        def call(b):
            inputs = recommender_inputs(b, seed=b)
            torch.testing.assert_close(rt(*inputs), interp(*inputs), rtol=1e-5, atol=1e-6)

        for b in (1, 2, 3):          # three compiles, the region is full
            call(b)
        call(1)                      # a hit: 1 becomes the most recently used
        call(4)                      # evicts 2 (least recently used), not 1
        call(5)                      # evicts 3
        stats = rt.stats()
        assert stats["compiles"] == 5
        assert stats["evictions"] == 2
        assert stats["regions"][0]["specializations"] == 3
        kept = sorted(spec.signature[0][0].dims[0] for spec in rt.jit.regions[0].strong.values())
        assert kept == [1, 4, 5]
        hits = stats["specialized_region_calls"]
        call(4)
        call(5)
        call(1)
        assert rt.stats()["specialized_region_calls"] == hits + 3
        # An evicted signature comes back: re-promoted, reinstalled from the compiled
        # future (no second compile of the same key), evicting the LRU one.
        call(2)
        stats = rt.stats()
        assert stats["compiles"] == 5 and stats["evictions"] == 3
        kept = sorted(spec.signature[0][0].dims[0] for spec in rt.jit.regions[0].strong.values())
        assert kept == [1, 2, 5]


# ---------------------------------------------------------------- no compile storm -----


def test_shape_jitter_does_not_cause_a_compile_storm():
    program = h.compiled("recommender")
    rng = random.Random(1234)
    batches = [rng.randint(1, 64) for _ in range(400)]
    inputs = {b: recommender_inputs(b, seed=b) for b in set(batches)}
    with h.torch_threads(1), dynvm.Runtime(program) as rt:   # the default JitConfig
        assert not rt.jit.config.sync
        for b in batches:
            rt(*inputs[b])
        h.wait_drained(rt)
        stats = rt.stats()
    distinct = len(set(batches)) * len(rt.jit.regions)   # one signature per batch size
    assert stats["compiles"] <= distinct / 4, (
        f"{stats['compiles']} compiles ({stats['family_compiles']} of families) for "
        f"{distinct} distinct signatures in 400 calls ({stats['promotions']} promotions, "
        f"{stats['dropped_tasks']} dropped)")
    # A detached region's calls (Note [Detached regions]) are counted apart.
    assert stats["interpreted_region_calls"] + stats["specialized_region_calls"] + \
        stats["detached_program_calls"] == 400
    # Recorded for the report: the actual figure.
    print(f"shape jitter: {stats['compiles']} compiles ({stats['family_compiles']} "
          f"families) / {distinct} signatures / 400 calls")


# ---------------------------------------------------------------- counters -------------


def test_stats_has_every_field():
    program = h.compiled("recommender")
    with dynvm.Runtime(program, jit=h.eager_config(guard_failure_sample_rate=1)) as rt:
        inputs = recommender_inputs(4)
        for _ in range(3):
            rt(*inputs)
        rt(*recommender_inputs(5))
        stats = rt.stats()
    for field in ("interpreted_region_calls", "specialized_region_calls", "compiles",
                  "compile_seconds", "queue_length", "dropped_tasks", "guard_failures",
                  "deopts", "evictions", "promotions", "compile_failures", "regions"):
        assert field in stats, field
    assert stats["interpreted_region_calls"] == 2
    assert stats["specialized_region_calls"] == 2
    assert stats["compiles"] == 2 and stats["compile_seconds"] > 0
    assert stats["queue_length"] == 0 and stats["dropped_tasks"] == 0
    assert stats["guard_failures"] == 1
    assert stats["deopts"] == 0 and stats["evictions"] == 0
    region = stats["regions"][0]
    for field in ("calls", "hit_rate", "specializations", "guard_failures", "deopts",
                  "last_guard_failure"):
        assert field in region, field
    assert region["calls"] == 4
    assert region["hit_rate"] == pytest.approx(0.5)
    assert region["specializations"] == 2
    assert "shape: expected (4, 13), got (5, 13)" in region["last_guard_failure"]


def test_jit_false_has_no_jit_stats():
    stats = dynvm.Runtime(h.compiled("recommender"), jit=False).stats()
    assert stats["jit"] is False
    assert "compiles" not in stats


def test_the_horizon_is_the_regions_age_when_that_is_longer():
    """Note [Rent or buy]: a key a quarter of the window, 0.3 ms a call, 15% saved, does
    not pay a 50 ms compile over the fixed 1000 calls (11 ms), and does once the region
    has run 5000 calls (the interpreter has by then lost 56 ms on it)."""
    config = JitConfig()
    assert horizon(config, 0) == horizon(config, 1000) == config.horizon_calls
    assert horizon(config, 5000) == 5000
    assert not decide(config, 16, 8, 3e-4, 0.15, 0.05).promote
    assert not decide(config, 16, 8, 3e-4, 0.15, 0.05, calls_so_far=1000).promote
    late = decide(config, 16, 8, 3e-4, 0.15, 0.05, calls_so_far=5000)
    assert late.promote and late.benefit_seconds == pytest.approx(16 / 64 * 5000 * 3e-4 * 0.15)


def test_a_key_that_never_pays_over_the_fixed_horizon_is_promoted_once_it_has():
    """A region that runs one shape: with a horizon of one call its benefit never beats
    the compile at a fixed horizon; the rent-or-buy horizon promotes it once the calls
    so far (detached ones included) x its mean time x the speed-up pass the compile
    cost, not before."""
    program = h.compiled("recommender")
    config = JitConfig(horizon_calls=1, expected_speedup=1.0, compile_seconds_base=0.02,
                       compile_seconds_per_instruction=0.0, families=False, sync=True)
    runtime = dynvm.Runtime(program, "cpu", jit=config)
    inputs = h.demo("recommender").sample_inputs(random.Random(5))
    for _ in range(20_000):
        runtime(*inputs)
        if runtime.stats()["promotions"]:
            break
    stats = runtime.stats()
    assert stats["promotions"] >= 1 and stats["compiles"] >= 1
    promoted = [rj for rj in runtime.jit.regions.values() if rj.counters.promotions]
    assert promoted
    for region_jit in promoted:
        ((key, key_stats),) = region_jit.profile.table.items()
        share = region_jit.profile.recurrence(key) / config.window
        # The time the interpreter had lost on it paid for its compile ...
        assert share * region_jit.age() * key_stats.mean_seconds > 0.02
        # ... which the fixed horizon of one call would never have said.
        assert share * config.horizon_calls * key_stats.mean_seconds < 0.02
