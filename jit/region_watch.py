"""The watch of a region's slot: when its misses are profiled, sampled, or not at all.

Watching a region (dynvm.jit.region_jit) is how the JIT learns which shapes recur; it
costs every watched call a layout key and a profile update. A `RegionWatch`, held by the
region's `RegionJit` as `watch`, decides, at a check every `COLD_CHECK_EVERY` region
calls, how much watching the region is worth: all of its misses, one in `sample_every`,
none for a cold period, or none at all with the slot detached.

Its interface: it reads its region only through `WatchedRegion` (below: the profiles,
counters, pending keys and installed specializations, the region's call counts and
policy inputs, and the two requests it makes, `compiles_locally` and `detach`), always
under the slot's lock, and never the engine. It offers the slot's hot path plain
attributes (`cold`: calls left to run unwatched; `cold_unlooked`: whether those skip
the lookups too; `unlooked_calls`; `price_signing`), and methods for the slot's events:
`signed` and `left` (what a profiled miss cost), `profiled` (after each profiled miss:
sampling and the periodic check), `check_now` and `reattached`. Stats read
`sample_every`, `watch_cost_seconds` and `checked`.

Note [Cold regions]
~~~~~~~~~~~~~~~~~~~
Watching a region costs a signature, a lookup and a profile update per interpreted
call, a few microseconds. For a region that runs in microseconds (a loop body over small
tensors) that is a large share, and it buys nothing when no specialization of the region
will pay for its compile at the traffic it sees. Every `COLD_CHECK_EVERY` interpreted
calls a region computes the policy's own benefit (jit.policy `benefit_seconds`: share of
the window x horizon x mean time x speed-up) for each signature and family seen at least
twice, and if even the best, times `COLD_SLACK`, is below the compile cost, its next
misses are not profiled. The bound is the policy's formula with the policy's figures on
purpose. It once took the slowest signature as if seen on every call: the loop body of
`dynvm bench loop` (each batch size a fraction of the window, never promoted) stayed
profiled on every entry, 1.26x the interpreter over 1200 calls. A bound at the window's
traffic but with each key's fastest call instead of its mean (c6be771) fixed that but
fell below the policy's benefit: albert's region in the zoo, which the policy promotes a
few calls after the first check, was detached first and never promoted (JIT 0.94x the
interpreter instead of 0.75x). With the policy's mean and the slack of 2, a key the
policy is about to promote keeps its region watched (the mean grows with a loaded host,
and so does the policy's benefit), and a region whose best key is far from paying stops
being watched. The mean is capped at `STALL_CAP` x the key's fastest call: one call
preempted for 27 ms on the loaded test machine once kept a 25 us loop region watched
(albert's mean is 1.3x its fastest call on a loaded host). If the bound says cold, its
next misses are not
profiled: with no specialization installed `enter` returns at once, otherwise it still
looks up the specializations it has and only skips the profiling of a miss. The period
doubles each time the bound still holds (up to `COLD_CALLS_MAX`), so that a region
whose shapes grow is looked at again. The horizon in the bound is the policy's (Note
[Rent or buy] in dynvm.jit.policy): it grows with the region's age, so a region found
cold while young may be found worth watching once it is old enough to pay. A region
whose promotions are decided elsewhere (a fleet's compile service, Note [Fleet hooks])
never goes cold here.

A specialization that measured slower than the interpreter (Note [Probation] in
dynvm.jit.probation) is dropped and its key backs off as after a failed compile: not
promoted again for `failed_compile_backoff_calls` region calls, doubling each time; the
region checks the bound at once (its speed-up estimate now includes the loss), so a
region whose every specialization loses runs interpreted, watched only cheaply. A loss
within the noise is held out of the estimate until the key's retry measured it again
(Note [One noisy verdict] in jit.savings): one noisy verdict left bloom's region
interpreted for good. The check comes every 64 profiled calls (it was 256: gnn's
300-call workload, a new shape every call, paid for watching its one region on every
call and was never checked). A cold period also skips the lookups, not only the
profiling, when they cost more than they found since the last check, by measurement: the
misses' layout keys and the region's resolution of new layouts per call against the
hits' savings, each priced by its specialization's probation verdict (kernel time x (1 /
ratio - 1)). On a shape storm (gnn) most calls are new layouts whose resolution (a
strong signature with new interned shapes) costs more than the few hits save. The rule
was "hits under half of the calls" once (it stays where no verdict prices a hit,
probation off); that switched off llama's kept family kernel (0.93-0.95x the interpreter
on its half of the shapes) whenever a window saw 31 hits in 64, and as the skipped
period's calls hit nothing by construction, every later check agreed: it served 4% of
the calls. Hits are now judged over the calls that looked up.

Note [Sampled watching]
~~~~~~~~~~~~~~~~~~~~~~~
A region that could pay by the bound (Note [Cold regions]) but that the policy does not
promote (phi's one region on a quiet host: four shapes, each a quarter of the window,
benefit within 2x of the compile cost, never above it) would pay the profiling of every
miss forever. So after `SAMPLE_AFTER` checks in a row that kept the region watched with
no promotion, only one miss in `sample_every` is profiled (doubling at each such check,
up to `SAMPLE_MAX`); the others take the cold path (no signature when nothing is
installed, no profile update otherwise). The policy still sees the traffic, scaled:
every figure it uses is a share of the window or a mean time, which a uniform sample of
the misses keeps; what grows is the delay before a shape that starts recurring is
promoted (at most `SAMPLE_MAX` times as many region calls); back-off periods count
region calls, so sampling does not stretch them.

Each check also prices the watch, by measurement: a profiled miss costs its `leave`
(the median of the recent ones, timed there) and its layout key (timed on one miss per
check), plus the region's mean cost per call of resolving new layouts (gnn, a new shape
on almost every call: ~20-100 us on a ~250 us region, and its re-attached watch ran
1.26x the interpreter), so a region is profiled on no more misses than keep that under
`WATCH_SHARE` (1%) of its typical call (the mean of its keys' fastest calls), less
what the cold checks themselves cost per call (timed; they run every
`COLD_CHECK_EVERY` region calls whatever the sampling). Where even the sparsest
sampling leaves the watch over that share, a region whose best key is only within
`COLD_SLACK` of paying goes cold instead (a key that pays now keeps it watched): the
loop workload's outer region (~0.1 ms; with eager in the rotation its mean, and so its
benefit, rose into the slack band) stayed watched at one miss in 16 and ran 1.06-1.09x
the interpreter, its profiled misses ~55 us each and its checks ~85 us. Until
`WATCH_SAMPLES` leaves have run, the price is the prior `WATCH_SECONDS` (bench.
profile_overhead --entry: +5.6 us on the loop body, a 10 us region, at load 12). The
prior was the price for good once, and it was wrong by 2-3x on the zoo's transformers:
llama's profiled miss measures ~3.5 us of layout key and ~10-12 us of leave (two
families' profiles, the policy's bound) on its ~330 us region, so it was profiled on
every miss and ran 1.05x the interpreter with nothing specialized; its median, not its
mean, because a leave that waits for the GIL behind a background compile measured 143
us on average. Of the leave, the policy's inputs (the speed-up estimate and the compile
cost) are taken once per check or change of the tables, not per miss. So:
`dynvm bench loop`'s two small regions (10-20 us) are profiled on one miss in 16 after
their first check, the zoo's small transformers (~0.3 ms) on one in 4, a transformer of
many milliseconds on every miss. A promotion resets the doubling to that floor; so does
a cold period. stats()["regions"] shows it per region (`sample_every`, and the measured
`watch_cost_seconds`).

Note [Sampling a rotation]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The sample of Note [Sampled watching] keeps each key's share of the window only if it
does not follow the traffic's own period. A fixed gap did: after each profiled miss the
next `sample_every - 1` were skipped, and a traffic that cycles through its shapes in a
fixed order (a client looping over its batch sizes; the zoo's four points, taken in
turn by `dynvm bench zoo`'s seasoning) has a period that divides 4, 8 and 16, so every
profiled miss was the same shape. The zoo's gpt2 (2026-12-06 23:26 UTC, 2-core AMD EPYC
Zen 5, no AMX), sampled at one miss in 16 from its second check on: its window held one
shape's family 61 times in 64 and the other shapes once or twice, so that key's benefit
was taken at ~0.95 of the calls where it has half of them, and the other keys' at
nothing; the policy promoted it at call 913 ("seen 61 of the last calls, benefit 36.82
ms vs compile cost 36.80 ms") and would never have promoted the others from that
window. Which shape won was the phase at which the sampling began, so the same model
compiled 0, 1 or 3 kernels from run to run (gpt2 and albert in the zoo's rows of
2026-12-06 20:27, 22:37 and 22:45). So the gap to the next profiled miss is drawn at
random, uniform over 0 .. 2 x `sample_every` - 2 (mean `sample_every`): one draw per
profiled miss, from a generator seeded per watch (the same calls give the same sample).
With it gpt2's window at one in 16 held its keys 30, 18, 16 and 14 times in 64 (a
family of two shapes, and one shape each), their shares of the calls.

The bias had been promoting most of the zoo's small transformers: weighed at their true
shares with the prior `expected_speedup` (0.15), their best keys pay only at ~1,600-2,100
calls (gpt2: a family of half the calls, 0.26 ms a call, against a 36.8 ms compile), so
`dynvm bench zoo` (1,024 seasoning calls, then 256 timed) ran 20 of its 23 transformers
interpreted where the biased window had promoted 1-5 kernels each (23:28-23:39 UTC,
both arms on this host, load 1.1-2.1), though their kernels measure 0.47-0.76x the
interpreter here (gpt2's family 0.64, albert's 0.76, bert's exact ones 0.47 and 0.54).
With the prior at 0.3 the same unbiased policy promoted every one of the 23 to 100%
specialized within the seasoning, in two runs (gpt2 0.76-0.77x the interpreter, albert
0.82-0.83x; 23:40 and 00:01 UTC, load 2.0); at 0.25 (the mean saving of the 23 first
kernels measured here, median 0.26, quartiles 0.19-0.30) 20 of 23, not gpt2 (its key
paid at ~1,220 calls, after the timed ones) nor albert (an exact kernel measured ~1.0x,
so its region expected 1% of the next) nor bloom. The prior is JitConfig's; the zoo's
report now states, per model left interpreted, the key the policy waits for and the
calls at which it pays (jit.settling.best_waiting).

Note [Detached regions]
~~~~~~~~~~~~~~~~~~~~~~~
Even a cold slot costs its region an `enter`, a ticket and a `leave` per entry (about a
microsecond: on gnn's and loop's tiny regions that alone kept the JIT slower than the
interpreter). So a region that goes cold with nothing installed and nothing pending (it
never promoted, or probation dropped all it had) is detached: the engine puts the
interpreter's plain unit back (`install_slot(index, None)`), and its entries cost exactly
what they cost without the JIT; they are not counted in the region's counters any more.
It is re-attached after a period of *program* calls (the Runtime counts them: one integer
compare per call, nothing per region), doubling each time it is detached again (from
`DETACH_CALLS` up to `COLD_CALLS_MAX`), so that changing traffic is looked at again; once
re-attached its calls are watched, at the sampling it had, until the next cold check
decides again. The period is at least long enough that the re-attached window (its
`COLD_CHECK_EVERY` region calls: the profiled ones at the watch's measured price, the
others at `SLOT_SECONDS` each, and the check's measured time) costs at most
`PROBE_SHARE` (0.1%) of the region's time over the period: the region was found not
worth watching, so looking again must be cheap. With 64 program calls for the first
period, gnn (a new shape almost every call, profiled misses of ~60 us on a ~250 us
region, one in 16 profiled) spent 14% of its steady calls re-attached and ran 1.002-1.005
x the interpreter against an A/A of 1.002-1.003; priced, its first period was 545
calls on a quiet host (the next 1,090), and about 5% of its steady calls ran
re-attached. A region whose promotions are decided elsewhere (a fleet's compile service,
`online_compile=False`) never goes cold, so it is never detached; connecting a fleet
re-attaches every detached region.
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

from dynvm.jit.policy import EXACT, FAMILY, PolicyInputs, benefit_seconds

if TYPE_CHECKING:
    from dynvm.jit.config import JitConfig
    from dynvm.jit.profiler import RegionProfile
    from dynvm.jit.region_slot import RegionCounters, Specialization

COLD_CHECK_EVERY = 64
COLD_CALLS_MAX = 1 << 16
COLD_SLACK = 2.0    # Note [Cold regions]: watched while the best key is within 2x of paying
STALL_CAP = 2.0     # ... with each key's mean time at most this x its fastest call
SAMPLE_AFTER = 2    # Note [Sampled watching]: checks without a promotion before sampling
SAMPLE_MAX = 16     # ... and the sparsest sampling: one profiled miss in this many
SAMPLE_SEED = 0x5A4D   # Note [Sampling a rotation]: the gaps' generator's seed
WATCH_SECONDS = 5e-6   # a profiled miss over the plain unit, until measured (below)
WATCH_SAMPLES = 8      # profiled misses measured before their mean replaces the prior
WATCH_SHARE = 0.01     # the share of a region's time its watching may cost
DETACH_CALLS = 64   # program calls a region first stays detached (Note [Detached regions])
PROBE_SHARE = 0.001    # ... at least long enough that a re-attached window costs this share
SLOT_SECONDS = 1e-6    # ... pricing an unprofiled entry of an attached slot at this


class WatchedRegion(Protocol):
    """What a `RegionWatch` reads of its region's slot (dynvm.jit.region_jit.RegionJit),
    always holding the slot's lock, and the two requests it makes of it."""

    profile: RegionProfile
    family_profile: RegionProfile
    counters: RegionCounters
    pending: set
    resolve_seconds: float   # spent resolving new layouts so far

    def installed(self) -> list[Specialization]:
        """The specializations in the slot's tables."""

    def region_calls(self) -> int:
        """The region's calls through the slot (interpreted + specialized)."""

    def age(self) -> int:
        """The region's calls, detached ones included (Note [Rent or buy])."""

    def refresh_policy_inputs(self) -> PolicyInputs:
        """The speed-ups and compile seconds by kind as the policy takes them now."""

    def compiles_locally(self) -> bool:
        """Whether promotions are decided here (Note [Fleet hooks])."""

    def detach(self, period: int) -> None:
        """Ask the engine to detach the slot for `period` program calls."""


class RegionWatch:
    """The watch of one region (module docstring): its state and checks, over the
    `WatchedRegion` it is given; every method runs holding that slot's lock, except
    the hot path's reads of `cold`, `cold_unlooked` and `price_signing`."""

    def __init__(self, region: WatchedRegion, config: JitConfig) -> None:
        self._region = region
        self._config = config
        self._clock_fn = time.perf_counter
        self.cold = 0                          # calls left to run unwatched
        self._cold_period = COLD_CHECK_EVERY
        self._since_cold_check = 0
        self.cold_unlooked = False   # a cold period that skips the lookups too
        # Note [Sampled watching]: one miss in `sample_every` is profiled; checks in a
        # row that found the region worth watching but nothing was promoted.
        self.sample_every = 1
        # The gaps between profiled misses (Note [Sampling a rotation]): seeded, so that
        # a process given the same calls samples the same misses.
        self._gaps = random.Random(SAMPLE_SEED)
        self._sample_floor = 1   # from the watch's cost against the region's time
        self._idle_checks = 0
        self._promotions_seen = 0
        # (region calls, hits, calls that looked nothing up) at the last cold check
        self._marks = (0, 0, 0)
        self.unlooked_calls = 0       # calls that took the first cold path of `enter`
        self._detach_period = DETACH_CALLS   # program calls (Note [Detached regions])
        self.checked = False   # its first cold check has run (Jit.settled)
        self.judged_cold = False   # ... and the latest found it cold (Note [Settled])
        self.profiled_at = 0   # the region's calls at its latest profiled miss (the same)
        # The watch's measured price (Note [Sampled watching]): the recent profiled
        # leaves' seconds, and a layout key's, timed on one miss per cold check.
        self._leave_costs: deque[float] = deque(maxlen=WATCH_SAMPLES * 4)
        self.signing_costs: deque[float] = deque(maxlen=WATCH_SAMPLES)
        self.price_signing = True
        self.watch_cost_seconds = WATCH_SECONDS
        self._miss_seconds = WATCH_SECONDS   # ... with new layouts' resolution per call
        self._check_costs: deque[float] = deque(maxlen=WATCH_SAMPLES)   # cold checks' seconds
        self._watch_affordable = True   # within WATCH_SHARE at some sampling (measured)

    def signed(self, seconds: float) -> None:
        """A profiled miss's layout key took `seconds` (timed when `price_signing`)."""
        self.price_signing = False
        self.signing_costs.append(seconds)

    def left(self, seconds: float) -> None:
        """A profiled miss's `leave` took `seconds`: the watch's own price."""
        self._leave_costs.append(seconds)

    def profiled(self) -> None:
        """A miss was profiled (holding the lock): sample the next ones (Note [Sampled
        watching]) and check the bound every COLD_CHECK_EVERY region calls."""
        if self.sample_every > 1 and not self.cold:
            # Note [Sampled watching], Note [Sampling a rotation]: a random gap, of mean
            # `sample_every`, to the next profiled miss.
            self.cold = self._gaps.randrange(2 * self.sample_every - 1)
            self.cold_unlooked = False          # installed ones are still looked up
        self.profiled_at = self._region.region_calls()
        self._since_cold_check += 1
        # Every COLD_CHECK_EVERY region calls, profiled or sampled away (Note
        # [Sampled watching]): a sampled region is not looked at 16x less often.
        if self._since_cold_check * self.sample_every >= COLD_CHECK_EVERY:
            self.check_now()

    def check_now(self) -> None:
        """Check the bound now (holding the lock): after a measured loss, say."""
        self._since_cold_check = 0
        self._check_cold()

    def _check_cold(self) -> None:
        """Note [Cold regions] (holding the lock)."""
        # Only the process that decides promotions may stop watching: while a compile
        # service (or `dynvm precompile`) decides, every miss is an observation it needs.
        if self._region.pending or not self._region.compiles_locally():
            return
        self.checked = True
        started = self._clock_fn()
        try:
            self._judge_cold()
        finally:
            self._check_costs.append(self._clock_fn() - started)

    def _judge_cold(self) -> None:
        region, config = self._region, self._config
        inputs = region.refresh_policy_inputs()
        # The policy's own benefit (jit.policy) of the best key at the window's traffic,
        # with its mean time (capped: a stall), and COLD_SLACK to spare (Note [Cold
        # regions]), over its kind's compile cost (Note [Promotion by kind]).
        calls = region.age()
        priced = [(benefit_seconds(config, profile.recurrence(key),
                                   min(stats.mean_seconds, STALL_CAP * stats.min_seconds),
                                   inputs.speedup(kind), calls), inputs.cost(kind))
                  for profile, kind in ((region.profile, EXACT),
                                        (region.family_profile, FAMILY))
                  for key, stats in profile.table.items() if stats.count > 1]
        counters = region.counters
        self._price_watching()
        calls, hits = counters.interpreted + counters.specialized, counters.specialized
        # Hits are judged over the calls that looked up: a cold period that skipped the
        # lookups hit nothing by construction, and counted in, it kept the next period
        # unlooked too, for good (llama's kept kernel served 4% of its calls).
        looked = calls - self._marks[0] - (self.unlooked_calls - self._marks[2])
        since_hits = hits - self._marks[1]
        self._marks = (calls, hits, self.unlooked_calls)
        # Watched: a key that pays now, or one within COLD_SLACK of paying while the
        # watch fits its share of the region's time (Note [Sampled watching]).
        if any(benefit >= cost for benefit, cost in priced) or (
                self._watch_affordable
                and any(COLD_SLACK * benefit >= cost for benefit, cost in priced)):
            self._cold_period = COLD_CHECK_EVERY
            self.judged_cold = False
            self._sample(counters.promotions)
            return
        self.judged_cold = True
        self._idle_checks = 0   # a cold period replaces the idle doubling
        installed = region.installed()
        self.sample_every = self._sample_floor
        # A specialization still on probation needs its hits for a verdict (and the
        # JIT to settle): its region keeps looking up.
        self.cold_unlooked = not any(spec.probation is not None for spec in installed) \
            and self._lookups_lose(looked, since_hits)
        self.cold = self._cold_period
        self._cold_period = min(COLD_CALLS_MAX, 2 * self._cold_period)
        counters.cold_periods += 1
        if not installed:
            # Note [Detached regions]: nothing here can hit; not even a cold slot pays.
            period = min(COLD_CALLS_MAX, max(self._detach_period, self._probe_period()))
            self._detach_period = min(COLD_CALLS_MAX, 2 * period)
            region.detach(period)

    def _probe_period(self) -> int:
        """Note [Detached regions] (holding the lock): the program calls to stay detached
        so that the next re-attached window (COLD_CHECK_EVERY region calls at the
        sampling the region has now, then a check) costs at most `PROBE_SHARE` of the
        region's time meanwhile, by the watch's measured price."""
        table = self._region.profile.table.values()
        typical = sum(s.min_seconds for s in table) / max(1, len(table))
        if typical <= 0.0:
            return DETACH_CALLS
        check = _median(self._check_costs) if self._check_costs else 0.0
        window = COLD_CHECK_EVERY * (SLOT_SECONDS + self._miss_seconds / self.sample_every) \
            + check
        return int(window / (PROBE_SHARE * typical)) + 1

    def _lookups_lose(self, looked: int, hits: int) -> bool:
        """Note [Cold regions] (holding the lock): whether, over the `looked` calls since
        the last check that looked up, the misses' lookups cost more than the `hits`
        saved, by measurement: a miss's layout key and the region's resolution of new
        layouts per call against each hit's saving by its specialization's verdict."""
        misses = looked - hits
        if misses <= 0:   # no miss (or nothing looked up): look, to have something to judge
            return False
        region = self._region
        per_miss = (_median(self.signing_costs) if self.signing_costs else WATCH_SECONDS) \
            + region.resolve_seconds / max(1, region.region_calls())
        judged = [spec for spec in region.installed() if spec.ratio is not None and spec.calls]
        weight = sum(spec.calls for spec in judged)
        if not weight:    # no verdict to price a hit by (probation off): hits vs misses
            return hits * 2 < looked
        # A hit saves its kernel's time x (1 / ratio - 1): ratio is kernel / interpreter.
        per_hit = sum(spec.seconds * max(0.0, 1.0 / spec.ratio - 1.0)
                      for spec in judged) / weight
        return misses * per_miss > hits * per_hit

    def _sample(self, promotions: int) -> None:
        """Note [Sampled watching] (holding the lock): after `SAMPLE_AFTER` checks in a
        row with no promotion, profile half as many misses; a promotion resets it."""
        if promotions != self._promotions_seen:
            self._promotions_seen, self._idle_checks = promotions, 0
            self.sample_every = self._sample_floor
            return
        self._idle_checks += 1
        if self._idle_checks >= SAMPLE_AFTER:
            self.sample_every = min(SAMPLE_MAX, 2 * self.sample_every)

    def _price_watching(self) -> None:
        """Note [Sampled watching] (holding the lock): profile one miss in as many as
        keeps the watch under `WATCH_SHARE` of the region's own time."""
        region = self._region
        table = region.profile.table.values()
        typical = sum(s.min_seconds for s in table) / max(1, len(table))
        # A profiled miss of a layout seen before, as measured here (its layout key and
        # its leave; the prior until a few have run), plus what resolving new layouts
        # has cost per call (a shape storm: most of it).
        watched = WATCH_SECONDS
        if len(self._leave_costs) >= WATCH_SAMPLES:
            watched = _median(self._leave_costs) + (
                _median(self.signing_costs) if self.signing_costs else 0.0)
        self.price_signing = True   # timed again on the next profiled miss
        cost = watched + region.resolve_seconds / max(1, region.region_calls())
        self.watch_cost_seconds = watched
        self._miss_seconds = cost
        # The checks run every COLD_CHECK_EVERY region calls whatever the sampling: their
        # share is the floor of the watch's price.
        checks = _median(self._check_costs) / COLD_CHECK_EVERY if self._check_costs else 0.0
        budget = WATCH_SHARE * typical - checks
        floor = 1
        while floor < SAMPLE_MAX and budget * floor < cost:
            floor *= 2
        self._watch_affordable = budget * floor >= cost
        self._sample_floor = floor
        self.sample_every = max(self.sample_every, floor)

    def reattached(self) -> None:
        """The engine put this slot back (Note [Detached regions]): profile the next
        calls, and check the bound again after `COLD_CHECK_EVERY` of them."""
        self.cold = 0
        self._since_cold_check = 0


def _median(samples) -> float:
    """The median of a few timings: the watch's price without the calls that waited for
    the GIL behind a compile or promoted (a mean took 143 us for a 4 us leave)."""
    ordered = sorted(samples)
    return ordered[len(ordered) // 2]
