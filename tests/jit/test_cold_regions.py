"""Note [Cold regions] and Note [Compile cost estimate]: a region whose specializations
could never pay for their compile stops being profiled (it costs the interpreter's
speed, not more), is looked at again later, and results never change; one slow first
compile does not make every later region look too expensive to compile."""

from __future__ import annotations

import dataclasses
import random
import time

import torch

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.jit.policy import EXACT
from dynvm.jit.region_watch import COLD_CHECK_EVERY, SAMPLE_AFTER, SAMPLE_MAX
from tests.jit._jit_helpers import compiled, demo

# A horizon of one call and a compile estimated at 10 s: no saving can ever pay, even
# with calls stretched 30x on a loaded host.
NEVER_PAYS = JitConfig(horizon_calls=1, compile_seconds_base=10.0)


def test_a_region_that_cannot_pay_goes_cold_and_stays_correct():
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=NEVER_PAYS)
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
        jit._compile_rates[EXACT].append(rate)
    estimate = jit.estimated_compile_seconds(10, EXACT)
    assert estimate == jit.config.compile_seconds_base + 0.0004 * 10


def test_a_region_whose_promotions_are_decided_elsewhere_never_goes_cold():
    """With online_compile=False (a fleet's service or `dynvm precompile` decides), every
    miss must stay an observation, however small the region."""
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=dataclasses.replace(
        NEVER_PAYS, online_compile=False))
    inputs = demo("recommender").sample_inputs(random.Random(2))
    for _ in range(COLD_CHECK_EVERY + 8):
        runtime(*inputs)
    assert runtime.stats()["cold_periods"] == 0
    region_jit = next(iter(runtime.jit.regions.values()))
    assert region_jit.profile.calls == COLD_CHECK_EVERY + 8



def _fed(per_call_over_cost: float, calls: int, horizon: int = 10_000,
         resolve_seconds: float = 0.0):
    """A region fed `calls` interpreted calls directly (its `leave`), four signatures in
    turn, each taking `per_call_over_cost` x (compile cost / horizon) seconds (with the
    default horizon and a 10 s compile, milliseconds: watching costs them nothing); K =
    the window, so the policy never promotes and only the cold bound decides. The
    horizon stays above the calls fed, so the region's age (Note [Rent or buy]) does not
    lengthen it."""
    program = compiled("recommender")
    config = JitConfig(expected_speedup=1.0, families=False, min_recurrence=64,
                       max_recurrence=64, window=64, horizon_calls=horizon,
                       compile_seconds_base=10.0)
    runtime = dynvm.Runtime(program, "cpu", jit=config)
    region_jit = next(iter(runtime.jit.regions.values()))
    cost = runtime.jit.estimated_compile_seconds(len(region_jit.region), EXACT)
    seconds = per_call_over_cost * cost / config.horizon_calls
    region_jit.resolve_seconds = resolve_seconds   # as if resolving layouts cost that
    for i in range(calls):
        region_jit.leave((("signature", i % 4),), seconds)
    return runtime, region_jit


def test_the_bound_is_the_policys_benefit_at_the_windows_traffic():
    """Four signatures, a quarter of the window each: a key seen on every call would pay
    (1.5x its compile), a quarter of the calls would not even with COLD_SLACK (0.75x).
    The region goes cold; the old bound (slowest signature as if seen on every call) kept
    it watched on every entry (Note [Cold regions])."""
    runtime, region_jit = _fed(1.5, COLD_CHECK_EVERY)
    assert region_jit.counters.cold_periods == 1
    assert runtime.stats()["detached_regions"] == 1


def test_a_key_within_the_slack_of_paying_keeps_its_region_watched():
    runtime, region_jit = _fed(3.0, COLD_CHECK_EVERY)   # a quarter: 0.75x, x2 slack: 1.5x
    assert region_jit.counters.cold_periods == 0
    assert runtime.stats()["detached_regions"] == 0


def test_a_watched_region_that_never_promotes_is_sampled():
    """Note [Sampled watching]: after SAMPLE_AFTER checks that kept it watched with no
    promotion, one miss in `sample_every` is profiled; the others take the cold path."""
    runtime, region_jit = _fed(3.0, SAMPLE_AFTER * COLD_CHECK_EVERY)
    assert region_jit.counters.cold_periods == 0 and region_jit.counters.promotions == 0
    assert region_jit.watch.sample_every == 2
    assert runtime.stats()["regions"][region_jit.region.index]["sample_every"] == 2
    inputs = demo("recommender").sample_inputs(random.Random(4))
    reference = dynvm.Runtime(compiled("recommender"), "cpu", jit=False)
    profiled = region_jit.profile.calls
    for _ in range(24):   # fewer than a check's worth of misses at one in 2
        torch.testing.assert_close(runtime(*inputs), reference(*inputs))
    # One miss in 2 on average, at random gaps (Note [Sampling a rotation]).
    assert 8 <= region_jit.profile.calls - profiled <= 16
    assert region_jit.counters.interpreted == SAMPLE_AFTER * COLD_CHECK_EVERY + 24
    # Up to SAMPLE_MAX while nothing is promoted; a promotion resets it.
    for _ in range(8):
        region_jit.watch._sample(0)
    assert region_jit.watch.sample_every == SAMPLE_MAX
    region_jit.watch._sample(1)
    assert region_jit.watch.sample_every == 1


def test_a_cold_region_still_looks_up_a_specialization_on_probation():
    """A cold period skips the lookups when hits were rare, except while an installed
    specialization awaits its probation verdict (gnn's kernels were never decided, and
    the JIT never settled, once their region went cold that way)."""
    from dynvm.jit.guards import GuardStrength
    from dynvm.jit.region_jit import Specialization

    runtime, region_jit = _fed(1.5, COLD_CHECK_EVERY - 1)
    spec = Specialization(signature=(("signature", 9),), strength=GuardStrength.STRONG,
                          fn=lambda regs: None, artifact=None)
    region_jit.install(spec)
    assert spec.probation is not None
    region_jit.leave((("signature", 0),), region_jit.profile.table[
        (("signature", 0),)].mean_seconds)
    assert region_jit.counters.cold_periods == 1 and region_jit.watch.cold
    assert not region_jit.watch.cold_unlooked


def test_a_region_of_microseconds_is_watched_on_a_sample_after_its_first_check():
    """Note [Sampled watching]: each check prices the watch; a region whose calls take
    ~0.3 us here (a loop body takes ~10 us) and whose best key pays now (4 keys a quarter
    of the window each, 5x: 1.25x its compile) is profiled on one miss in SAMPLE_MAX
    from its first check on, one of milliseconds on every miss."""
    _, tiny = _fed(5.0, COLD_CHECK_EVERY, horizon=10**8)
    assert tiny.watch.sample_every == SAMPLE_MAX and tiny.counters.cold_periods == 0
    _, large = _fed(3.0, COLD_CHECK_EVERY)
    assert large.watch.sample_every == 1 and large.counters.cold_periods == 0


def test_a_region_that_only_might_pay_is_not_watched_beyond_its_share():
    """Note [Sampled watching]: a key within COLD_SLACK of paying (0.75x its compile)
    keeps a millisecond region watched, but not a region of ~0.3 us, whose watch costs
    more than WATCH_SHARE of its time at the sparsest sampling: it goes cold (the loop
    workload's outer region stayed watched at one miss in 16 and ran 1.06-1.09x the
    interpreter, its checks alone ~1.3 us a call)."""
    _, tiny = _fed(3.0, COLD_CHECK_EVERY, horizon=10**8)
    assert not tiny.watch._watch_affordable and tiny.counters.cold_periods == 1
    _, large = _fed(3.0, COLD_CHECK_EVERY)
    assert large.watch._watch_affordable and large.counters.cold_periods == 0


def test_a_shape_storms_resolution_cost_prices_its_watch():
    """Note [Sampled watching]: what resolving new layouts costs per call counts in the
    watch's price: the millisecond region above, with resolutions costing 10x its call,
    is sampled at SAMPLE_MAX after its first check."""
    _, storm = _fed(3.0, COLD_CHECK_EVERY, resolve_seconds=10.0)
    assert storm.watch.sample_every == SAMPLE_MAX


def test_the_watch_is_priced_by_what_it_measured():
    """Note [Sampled watching]: the price of a profiled miss is measured (the median of
    the recent leaves, plus a layout key), not assumed: the millisecond region above is
    profiled on every miss while its leaves cost microseconds, and on one miss in
    SAMPLE_MAX once they cost a millisecond each (here: a profile that sleeps)."""
    _, cheap = _fed(3.0, COLD_CHECK_EVERY)
    assert cheap.watch.sample_every == 1
    assert cheap.watch.watch_cost_seconds < 1e-3
    runtime, slow = _fed(3.0, 0)
    record = slow.profile.record

    def slow_record(signature, seconds):
        time.sleep(1e-3)
        return record(signature, seconds)

    slow.profile.record = slow_record
    cost = runtime.jit.estimated_compile_seconds(len(slow.region), EXACT)
    for i in range(COLD_CHECK_EVERY):
        slow.leave((("signature", i % 4),), 3.0 * cost / runtime.jit.config.horizon_calls)
    assert slow.watch.watch_cost_seconds >= 1e-3
    assert slow.watch.sample_every == SAMPLE_MAX
    assert runtime.stats()["regions"][slow.region.index]["sample_every"] == SAMPLE_MAX


def _kept(region_jit, ratio: float, kernel_seconds: float):
    """Install a specialization that probation kept at `ratio` (kernel / interpreter),
    its kernel having taken `kernel_seconds` a call over 100 calls."""
    from dynvm.jit.guards import GuardStrength
    from dynvm.jit.region_jit import Specialization

    spec = Specialization(signature=(("signature", 9),), strength=GuardStrength.STRONG,
                          fn=lambda regs: None, artifact=None)
    region_jit.install(spec)
    spec.probation, spec.ratio = None, ratio
    spec.calls, spec.seconds = 100, 100 * kernel_seconds
    return spec


def test_a_cold_region_skips_its_lookups_only_where_they_cost_more_than_they_find():
    """Note [Cold regions]: the misses' lookups (a layout key each, plus the resolution
    of new layouts per call) against the hits' measured savings. A kernel kept at 0.9x
    on a millisecond region, hit on 20 of 64 calls, is still looked up (the old rule,
    hits under half, skipped it); a shape storm whose resolutions cost a millisecond a
    call is not."""
    _, region_jit = _fed(1.5, 0)
    _kept(region_jit, ratio=0.9, kernel_seconds=0.9e-3)   # a hit saves 0.1 ms
    region_jit.watch.signing_costs.append(2e-6)
    assert not region_jit.watch._lookups_lose(looked=64, hits=20)
    assert region_jit.watch._lookups_lose(looked=64, hits=0)
    region_jit.counters.interpreted = 64
    region_jit.resolve_seconds = 64 * 1e-3
    assert region_jit.watch._lookups_lose(looked=64, hits=20)


def test_a_period_that_skipped_its_lookups_does_not_count_against_the_next():
    """The calls of a cold period that looked nothing up hit nothing by construction:
    the next check judges the hits over the calls that looked up (counted in, llama's
    kept kernel stayed unlooked for good and served 4% of its calls)."""
    runtime, region_jit = _fed(1.5, COLD_CHECK_EVERY)
    assert region_jit.counters.cold_periods == 1
    _kept(region_jit, ratio=0.9, kernel_seconds=0.9e-3)
    region_jit.watch.signing_costs.append(2e-6)
    counters, (calls, hits, unlooked) = region_jit.counters, region_jit.watch._marks
    # 256 calls that skipped the lookups, then 64 that looked up and hit on 30
    region_jit.watch.unlooked_calls += 256
    counters.interpreted += 256 + 34
    counters.specialized += 30
    region_jit.watch._check_cold()
    assert region_jit.watch.cold and not region_jit.watch.cold_unlooked
    assert region_jit.watch._marks == (calls + 320, hits + 30, unlooked + 256)
