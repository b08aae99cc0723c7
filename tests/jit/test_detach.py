"""Note [Detached regions]: a region whose JIT cannot pay gives the interpreter its plain
unit back (its calls no longer reach the slot), is re-attached after a doubling period of
program calls, and results stay equal to the interpreter's throughout; a region whose
promotions are decided elsewhere is never detached."""

from __future__ import annotations

import dataclasses
import random
import time

import torch

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.jit.region_watch import COLD_CALLS_MAX, COLD_CHECK_EVERY, DETACH_CALLS
from tests.jit._jit_helpers import compiled, demo

# A horizon of one call and a compile estimated at 10 s: no saving can ever pay, even
# with calls stretched 30x on a loaded host.
NEVER_PAYS = JitConfig(horizon_calls=1, compile_seconds_base=10.0)


def _region_calls(runtime) -> int:
    return sum(r.counters.interpreted + r.counters.specialized
               for r in runtime.jit.regions.values())


def test_a_region_that_cannot_pay_is_detached_and_reattached():
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=NEVER_PAYS)
    reference = dynvm.Runtime(program, "cpu", jit=False)
    rng = random.Random(0)
    draws = [demo("recommender").sample_inputs(rng) for _ in range(4)]
    calls = 0

    def call():
        nonlocal calls
        inputs = draws[calls % len(draws)]
        torch.testing.assert_close(runtime(*inputs), reference(*inputs))
        calls += 1

    for _ in range(COLD_CHECK_EVERY):
        call()
    watched = len(runtime.jit.regions)
    stats = runtime.stats()
    assert stats["detached_regions"] == watched and stats["detachments"] == watched
    assert all(r["detached"] for r in stats["regions"].values())
    assert any("detached" in line for line in runtime.jit.event_log)
    detached_at = _region_calls(runtime)
    slots = runtime.interpreter._slots
    assert all(slots[index] is None for index in runtime.jit.regions)
    # Detached for at least DETACH_CALLS program calls, longer where the watch's price
    # says a re-attached window would cost more than PROBE_SHARE of the region's time.
    period = runtime.jit.detaching.reattach_at - runtime.jit.detaching.program_calls
    assert period >= DETACH_CALLS
    # Detached: the calls do not reach the slot.
    for _ in range(period - 1):
        call()
    assert _region_calls(runtime) == detached_at
    assert runtime.stats()["reattachments"] == 0
    # The period (in program calls) ends: re-attached, and the slot sees calls again.
    call()
    stats = runtime.stats()
    assert stats["reattachments"] == watched and stats["detached_regions"] == 0
    assert all(slots[index] is runtime.jit.regions[index] for index in runtime.jit.regions)
    assert any("re-attached" in line for line in runtime.jit.event_log)
    call()
    assert _region_calls(runtime) == detached_at + watched
    # Every entry is counted once: by the slot, or as a call run detached.
    assert _region_calls(runtime) + runtime.stats()["detached_program_calls"] == \
        watched * calls
    # Still cannot pay: after the next check it is detached again, for twice as long.
    for _ in range(COLD_CHECK_EVERY):
        call()
    stats = runtime.stats()
    assert stats["detached_regions"] == watched and stats["detachments"] == 2 * watched
    last = [line for line in runtime.jit.event_log if "detached" in line][-1]
    assert int(last.split("looked at again in ")[1].split()[0]) >= 2 * period
    assert stats["compiles"] == 0


def test_a_region_dearer_to_watch_stays_detached_longer():
    """Note [Detached regions]: the period is priced so that the re-attached window
    costs at most PROBE_SHARE of the region's time; a region whose profiled misses cost
    a millisecond each (a profile that sleeps) is looked at again only after several
    times as many program calls as one whose misses cost microseconds."""
    program = compiled("recommender")
    rng = random.Random(0)
    draws = [demo("recommender").sample_inputs(rng) for _ in range(4)]
    periods = []
    for delay in (0.0, 1e-3):
        runtime = dynvm.Runtime(program, "cpu", jit=NEVER_PAYS)
        for region_jit in runtime.jit.regions.values():
            region_jit.profile.record = _slowed(region_jit.profile.record, delay)
        for call in range(COLD_CHECK_EVERY):
            runtime(*draws[call % len(draws)])
        assert runtime.stats()["detached_regions"] == len(runtime.jit.regions)
        periods.append(runtime.jit.detaching.reattach_at - runtime.jit.detaching.program_calls)
    cheap, dear = periods
    # A millisecond a profiled miss against microseconds: the window costs several
    # times more (sampled at one miss in 16), and so does the period, up to its cap.
    assert cheap >= DETACH_CALLS and min(COLD_CALLS_MAX, 4 * cheap) <= dear


def _slowed(record, delay: float):
    def slow_record(signature, seconds):
        time.sleep(delay)
        return record(signature, seconds)
    return slow_record


def test_promotions_decided_elsewhere_never_detach():
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=dataclasses.replace(
        NEVER_PAYS, online_compile=False))
    inputs = demo("recommender").sample_inputs(random.Random(2))
    for _ in range(2 * COLD_CHECK_EVERY):
        runtime(*inputs)
    stats = runtime.stats()
    assert stats["detachments"] == 0 and stats["cold_periods"] == 0
    assert _region_calls(runtime) == 2 * COLD_CHECK_EVERY * len(runtime.jit.regions)


def test_connecting_a_fleet_reattaches():
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=NEVER_PAYS)
    inputs = demo("recommender").sample_inputs(random.Random(3))
    for _ in range(COLD_CHECK_EVERY):
        runtime(*inputs)
    assert runtime.stats()["detached_regions"] == len(runtime.jit.regions)

    class Fleet:
        observed_calls = 0

        def observed(self, region, signature, seconds):
            Fleet.observed_calls += 1

        def compiles_locally(self):
            return False

    runtime.jit.connect(Fleet())
    assert runtime.stats()["detached_regions"] == 0
    runtime(*inputs)
    assert Fleet.observed_calls == len(runtime.jit.regions)


def test_settled_waits_for_compiles_probation_and_first_cold_checks():
    program = compiled("recommender")
    runtime = dynvm.Runtime(program, "cpu", jit=JitConfig(sync=True, horizon_calls=10**9,
                                                          expected_speedup=1.0))
    assert not runtime.settled(), "no region has been looked at yet"
    assert dynvm.Runtime(program, "cpu", jit=False).settled()
    inputs = demo("recommender").sample_inputs(random.Random(4))
    installed_on_probation = False
    for _ in range(200):
        runtime(*inputs)
        regions = runtime.jit.regions.values()
        on_probation = any(s.probation is not None for r in regions for s in r.installed())
        installed_on_probation |= on_probation
        unchecked = any(not r.installed() and not r.watch.checked for r in regions)
        assert runtime.settled() == (not on_probation and not unchecked and not any(
            r.pending for r in regions) and not len(runtime.jit.queue))
    assert installed_on_probation
    assert runtime.settled()
    # While detached, no call looks entirely specialized to Runtime.region_calls.
    cold = dynvm.Runtime(program, "cpu", jit=NEVER_PAYS)
    for _ in range(COLD_CHECK_EVERY):
        cold(*inputs)
    assert cold.settled() and cold.stats()["detached_regions"]
    before = cold.region_calls()
    cold(*inputs)
    assert cold.region_calls()[1] > before[1]
