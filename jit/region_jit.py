"""One region's JIT state: its specializations behind guards, its profile, its slot.

`RegionJit` implements the VM's `RegionSlot` (dynvm.vm.slots). On entry it builds the
layout key of the live-ins (Note [Layout keys]) and looks it up in its memo of resolved
layouts: one dict lookup on the warm path. A new layout is resolved once: its strong
signature is looked up among exact specializations (the lookup is the strong guard: see
Note [Guard strength]), then among the family kernels' bounds, then among weak
specializations. A hit runs the specialization; a miss or a guard failure hands the
region back to the interpreter, which times it and calls `leave`, where the signature is
recorded and maybe promoted.

Note [Tiering]
~~~~~~~~~~~~~~
As in tiered JVMs, a shape first gets the cheapest code that covers it and is promoted
further only when that pays:

- tier 1, the family kernel: when a signature's family (dynvm.shape_cluster) recurs K
  times in the window and its benefit beats a compile, the family is compiled once for
  all its members (varying dims are runtime values, Note [Probes]);
- tier 2, the exact specialization: a signature that keeps hitting its family kernel is
  compiled exactly (all shapes folded, its arena planned for its exact sizes)
  when its frequency x family-kernel time x `exact_over_family_gain` over the horizon
  beats a compile. The check runs at K, 2K and 4K family hits of a signature, then
  every `TIER_CHECK_EVERY` (Note [Tier-2 checks] in jit.tiering).

A family that has seen a single member so far is no family yet: its signature is
promoted as an exact specialization directly.

The watch (Note [Cold regions], [Sampled watching], [Detached regions]) is a
`RegionWatch` the slot holds (dynvm.jit.region_watch); the slot is its `WatchedRegion`.

The slot and its engine: a `RegionJit` reaches the engine that made it only through
`RegionHost` (below), and offers the engine `region`, `live_in`, `pending`, `counters`,
`watch`, `installed()`, `install`, `compile_failed`, `forget_pending` and `reattached`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Protocol

from dynvm.jit.background import pause_for_calls
from dynvm.jit.guards import (
    GuardStrength,
    first_failure,
    layout_signer,
    strong_signer,
    weak_of,
    weak_signer,
)
from dynvm.jit.policy import (
    EXACT,
    FAMILY,
    Decision,
    PolicyInputs,
    benefit_seconds,
    decide,
    recurrence_threshold,
)
from dynvm.jit.probation import CONFIRMED, DEMOTE, DROP, EARLY_SAMPLES, Probation
from dynvm.jit.profiler import RegionProfile
from dynvm.jit.region_slot import RegionCounters, Specialization
from dynvm.jit.region_watch import RegionWatch
from dynvm.jit.savings import KernelSavings
from dynvm.jit.shadow import shadow_pacing, shadow_sample
from dynvm.jit.tiering import eviction_victim, exact_benefit, note_served, tier_check_due
from dynvm.shape_cluster import FamilyIndex

if TYPE_CHECKING:
    from dynvm.jit.config import JitConfig
    from dynvm.jit.probation import ProbationCounters
    from dynvm.jit.queue import CompileQueue
    from dynvm.shape_cluster import Family

SHADOW_BENEFIT = 1e18   # shadow samples run before compiles: a verdict is waiting on them
_MEMO_LIMIT = 4096
_MANY = object()       # a family with more than one member signature so far
_UNMATCHED = object()  # a signature not looked up among the family kernels yet
_COLD = object()       # the ticket of a call run unwatched (Note [Cold regions])
_NO_HITS = (0, 0)      # a signature's family hits and the clock at its latest


class RegionHost(Protocol):
    """What a `RegionJit` asks of the engine that holds it (dynvm.jit.engine.Jit): its
    settings, where background work runs, and the decisions and reports that are the
    engine's (promotions, detaching, what to log and trace)."""

    config: JitConfig
    fleet: object | None   # Note [Fleet hooks]: hears every profiled miss, when set
    queue: CompileQueue    # shadow samples run on its worker (Note [Probation])
    probation_counters: ProbationCounters

    def compiles_locally(self) -> bool:
        """Whether promotions are decided here (Note [Fleet hooks])."""

    def estimated_compile_seconds(self, instructions: int, kind: str) -> float:
        """The expected cost of a compile of a kernel of `kind` (Note [Compile cost
        estimate], Note [Promotion by kind])."""

    def clip_to_declared(self, region_jit: RegionJit, family: Family) -> Family:
        """`family` cut to the program's declared dim ranges."""

    def detached_program_calls(self, index: int) -> int:
        """Program calls that ran region `index` detached."""

    def promote(self, region_jit: RegionJit, target, decision: Decision) -> None:
        """Queue the compile of `target` (a signature or a Family)."""

    def detach(self, region_jit: RegionJit, period: int) -> None:
        """Detach the slot for `period` program calls (Note [Detached regions])."""

    def on_deopt(self, region_jit: RegionJit, spec: Specialization, error: Exception) -> None:
        """A specialization raised; the interpreter reruns the region."""

    def on_guard_failure(self, region_jit: RegionJit, explanation: str | None) -> None:
        """A miss where specializations were installed, explained or not (sampled)."""

    def on_probation(self, region_jit: RegionJit, spec: Specialization, verdict: str,
                     key=None) -> None:
        """A probation verdict (Note [Probation])."""

    def on_evict(self, region_jit: RegionJit, spec: Specialization) -> None:
        """A specialization left the slot's tables."""


class RegionJit:
    """A region's cache slot (dynvm.vm.slots): guards the installed specializations,
    profiles the misses, and asks the engine to promote what keeps coming back."""

    def __init__(self, engine: RegionHost, region, steps, writes_state: bool) -> None:
        """`steps`: the interpreter's own steps of the region, for shadow calls (Note
        [Probation]); `writes_state`: whether the region writes state (the KV cache):
        it is then never shadowed, since a sample runs it again later, on the compile
        worker, and would write a hit's old values into a cache slot another sequence
        may hold by then."""
        self.engine = engine
        self.region = region
        self.live_in = tuple(r.index for r in region.live_in)
        self._sign = strong_signer(self.live_in)
        # Note [Layout keys]: layout key -> (strong signature, its specialization or None)
        self._layout_sign = layout_signer(self.live_in)
        self._resolved: dict[tuple, tuple] = {}
        self._generation = 0   # bumped with every change of the tables
        self._weak_sign = weak_signer(self.live_in)
        self.strong: dict[tuple, Specialization] = {}
        self.weak: dict[tuple, Specialization] = {}
        self.family_kernels: dict[str, Specialization] = {}
        self.families = FamilyIndex(engine.config.bucket_ratio)
        self.family_profile = RegionProfile(engine.config.window)
        self._members: dict[str, object] = {}     # family key -> its one signature, or _MANY
        self._memo: dict[tuple, Specialization] = {}
        self._family_hits: dict[tuple, tuple[int, int]] = {}   # hits, clock
        self.profile = RegionProfile(engine.config.window)
        self.threshold = recurrence_threshold(engine.config, len(region))
        self.pending: set[tuple] = set()
        self.counters = RegionCounters()
        self._lock = threading.Lock()
        self._clock = 0
        self._clock_fn = time.perf_counter
        self.watch = RegionWatch(self, engine.config)
        self._steps = tuple(steps)
        self._writes_state = writes_state
        self.savings = KernelSavings(engine.config.expected_speedup)   # by kind
        self._shadow_ids = itertools.count()   # shadow samples' queue keys
        self._shadow_spaced = shadow_pacing().spaced   # Note [Shadow samples beside calls]
        self._verdicts_due: deque = deque()     # (spec, probation, ratio) from them
        self.resolve_seconds = 0.0   # spent resolving new layouts (Note [Probation])
        self._policy_inputs: PolicyInputs | None = None
        self._clipped: dict[str, str] = {}

    # -- RegionSlot --------------------------------------------------------------------

    def enter(self, regs: list):
        # Cold with nothing installed: no lookup can hit (the tables are read only here,
        # off the warm path); or cold with specializations that served less than half
        # of the calls before (Note [Cold regions]): looking up costs more than it finds.
        watch = self.watch
        if watch.cold and (watch.cold_unlooked or
                           not (self.strong or self.weak or self.family_kernels)):
            watch.cold -= 1
            self.counters.interpreted += 1
            watch.unlooked_calls += 1
            return _COLD
        key = self._layout_sign(regs)
        resolved = self._resolved.get(key)
        if resolved is None:
            resolved = self._resolve(key, regs)
        signature, spec = resolved
        if spec is not None:
            if spec.probation is not None and spec.probation.due(self._shadow_spaced):
                self._shadow_later(spec, regs)   # Note [Probation]: not on this call
            start = self._clock_fn()
            try:
                spec.fn(regs)
            except Exception as exc:  # deopt: the interpreter reruns the region
                self.counters.deopts += 1
                self.engine.on_deopt(self, spec, exc)
                return signature
            spec.seconds += self._clock_fn() - start
            spec.calls += 1
            self._clock += 1
            spec.last_used = self._clock
            self.counters.specialized += 1
            if spec.family is not None:
                self._family_hit(signature, spec)
            if self._verdicts_due:
                self._decide_due()
            return None
        if watch.cold:  # a miss, not profiled: nothing more can be promoted here
            watch.cold -= 1
            self.counters.interpreted += 1
            return _COLD
        if self.strong or self.weak:
            self._guard_failed(signature)
        if watch.price_signing:   # Note [Sampled watching]: what this miss's key cost
            start = self._clock_fn()
            self._layout_sign(regs)
            watch.signed(self._clock_fn() - start)
        return signature

    def _resolve(self, key: tuple, regs: list) -> tuple:
        """A new layout: its strong signature and the specialization serving it (Note
        [Layout keys]), memoized until the region's tables change."""
        generation = self._generation
        start = self._clock_fn()
        signature = self._sign(regs)
        spec = self.strong.get(signature)
        if spec is None:
            spec = self._memo.get(signature, _UNMATCHED)
            if spec is _UNMATCHED:
                spec = self._match_family(signature) if self.family_kernels else None
            if spec is None and self.weak:
                spec = self.weak.get(self._weak_sign(regs))
        found = (signature, spec)
        self.resolve_seconds += self._clock_fn() - start
        # Not memoized if the tables changed meanwhile (an install on the compile
        # thread): the answer may already be stale.
        if generation == self._generation:
            resolved = self._resolved
            if len(resolved) >= _MEMO_LIMIT:
                resolved.clear()
            resolved[key] = found
        return found

    def _tables_changed(self) -> None:
        self._generation += 1
        self._resolved.clear()
        self._policy_inputs = None

    def leave(self, signature: tuple, seconds: float) -> None:
        if signature is _COLD:
            return
        start = self._clock_fn()
        fleet = self.engine.fleet
        if fleet is not None:
            fleet.observed(self.region.index, signature, seconds)
        promotion = self._observe(signature, seconds)
        if promotion is not None:
            self.engine.promote(self, *promotion)
        # The watch's own price (Note [Sampled watching]).
        self.watch.left(self._clock_fn() - start)

    def _observe(self, signature: tuple, seconds: float) -> tuple | None:
        """Record a profiled miss; the (target, decision) to promote, if any."""
        with self._lock:
            self.counters.interpreted += 1
            stats = self.profile.record(signature, seconds)
            self.watch.profiled()   # Note [Sampled watching], Note [Cold regions]
            if signature in self.pending or signature in self.strong:
                return None
            family = self.families.observe(signature) if self.engine.config.families \
                else None
            target, recurrence, mean = signature, self.profile.recurrence(signature), \
                stats.mean_seconds
            if family is not None:
                family_stats = self.family_profile.record(family.key, seconds)
                member = self._members.setdefault(family.key, signature)
                if member is not signature and member != signature:
                    self._members[family.key] = member = _MANY
                if member is _MANY:
                    family_recurrence = self.family_profile.recurrence(family.key)
                    if not self._family_yields(family, family_recurrence,
                                               family_stats.mean_seconds, recurrence):
                        target, recurrence = family, family_recurrence
                        mean = family_stats.mean_seconds
            key = target if family is None or target is signature else family.key
            # Below K the policy never promotes (jit.policy decide): skip its inputs
            # (the speed-up estimate, the compile cost, the clipped family) on most misses.
            if recurrence < self.threshold or key in self.pending or \
                    self._backing_off(key) or not self.engine.compiles_locally():
                return None
            # The policy's inputs change slowly: taken once per cold check or change of
            # the tables, not on every miss (they were a third of a profiled miss).
            inputs = self._policy_inputs or self.refresh_policy_inputs()
            kind = FAMILY if target is family else EXACT
            speedup, cost = inputs.speedup(kind), inputs.cost(kind)
            calls = self.age()
            if benefit_seconds(self.engine.config, recurrence, mean, speedup, calls) <= cost:
                return None   # what decide() would say, without building its record
            if target is family and self._clipped_key(family) in self.family_kernels:
                # Its kernel is installed (under the clipped key): a late observation,
                # as the compile service gets them, must not promote it again.
                return None
            if target is family and self._family_bet_open():
                return None
            decision = decide(self.engine.config, recurrence, self.threshold, mean,
                              speedup, cost, calls)
            if not decision.promote:
                return None
            self.pending.add(key)
            self.counters.promotions += 1
        return target, decision

    def _family_yields(self, family, family_recurrence: int, family_mean: float,
                       recurrence: int) -> bool:
        """Whether a member of a family of several is weighed as its exact key (Note
        [A family that does not pay] in jit.policy): the member recurs K times, and its
        family, not compiling, backs off or does not pay for its compile (holding the
        lock)."""
        if recurrence < self.threshold or family.key in self.pending:
            return False
        if self._backing_off(family.key):
            return True
        inputs = self._policy_inputs or self.refresh_policy_inputs()
        return benefit_seconds(self.engine.config, family_recurrence, family_mean,
                               inputs.speedup(FAMILY), self.age()) <= inputs.cost(FAMILY)

    def refresh_policy_inputs(self) -> PolicyInputs:
        """The speed-ups and compile seconds by kind for the policy (Note [Promotion by
        kind]), kept until the next cold check or change of the tables (holding the lock)."""
        size, installed, table = len(self.region), self.installed(), self.profile.table
        inputs = PolicyInputs(self.savings.expected(EXACT, installed, table),
                              self.savings.expected(FAMILY, installed, table),
                              self.engine.estimated_compile_seconds(size, EXACT),
                              self.engine.estimated_compile_seconds(size, FAMILY))
        self._policy_inputs = inputs
        return inputs

    def _clipped_key(self, family) -> str:
        """The key of `family` cut to the declared ranges (Jit.clip_to_declared),
        memoized: the clip depends only on the family and the program."""
        clipped = self._clipped.get(family.key)
        if clipped is None:
            if len(self._clipped) >= _MEMO_LIMIT:
                self._clipped.clear()
            clipped = self._clipped[family.key] = \
                self.engine.clip_to_declared(self, family).key
        return clipped

    def _shadow_later(self, spec: Specialization, regs: list) -> None:
        """Queue a shadow sample of this hit (Note [Probation]) on the compile worker,
        on a copy of its registers taken before the specialization writes its outputs;
        under the synchronous switch it runs here, first."""
        copy = regs.copy()
        key = f"shadow {spec.artifact.key} {next(self._shadow_ids)}"
        self.engine.queue.submit(key, SHADOW_BENEFIT, lambda: self._shadow(spec, copy))

    def _shadow(self, spec: Specialization, regs: list) -> None:
        """A shadow sample of a hit, on the compile worker (jit.shadow)."""
        shadow_sample(self, spec, regs)

    def _decide_due(self) -> None:
        """The verdicts the background shadow samples reached (Note [Probation])."""
        while self._verdicts_due:
            try:
                spec, probation, ratio = self._verdicts_due.popleft()
            except IndexError:   # another thread took it
                return
            if spec.probation is probation:
                self._decide(spec, ratio)

    def _interpret(self, regs: list, activity=None) -> float | None:
        """Seconds the interpreter takes over the region on `regs` (None if it raised:
        the specialization's result stands, and this call gives no sample). With
        `activity` (the calls in flight; a shadow sample on the compile worker) the run
        pauses between steps while a call is in flight, and its pauses are not its
        time (Note [A shadow sample pauses for calls] in jit.shadow)."""
        clock = self._clock_fn
        start, paused = clock(), 0.0
        try:
            if activity is None:
                for step in self._steps:
                    step(regs)
            else:
                for step in self._steps:
                    step(regs)
                    if activity.in_flight > 0:   # one attribute read per step
                        paused += pause_for_calls(clock)
        except Exception:  # noqa: BLE001 — a shadow run must never fail the call
            return None
        return clock() - start - paused

    def _decide(self, spec: Specialization, ratio: float) -> None:
        """Note [Probation]: keep, demote (re-plan without the arena) or drop."""
        passed = spec.probation.passes(ratio)
        spec.ratio, spec.probation = ratio, None
        key = spec.promoted_as if spec.promoted_as is not None else spec.target
        # Note [One noisy verdict] in jit.savings: a loss within the noise is held once.
        self.savings.record(FAMILY if spec.family is not None else EXACT, ratio, key,
                            lost=not passed)
        self._policy_inputs = None
        if passed:
            self.engine.on_probation(self, spec, CONFIRMED)
            return
        with self._lock:
            if not self._remove(spec):
                return  # evicted meanwhile
            if spec.arena:
                self.pending.add(key)  # the re-plan installs under it
        if spec.arena:
            self.engine.on_probation(self, spec, DEMOTE, key)
        else:
            self.savings.dropped(key)
            self.compile_failed(key)  # backs off (Note [Cold regions])
            self.engine.on_probation(self, spec, DROP, key)
            with self._lock:  # the measured loss lowers the region's best saving: look now
                self.watch.check_now()

    def _remove(self, spec: Specialization) -> bool:
        """Take `spec` out of its table (holding the lock)."""
        for table in self._tables():
            for key, installed in table.items():
                if installed is spec:
                    del table[key]
                    self._tables_changed()
                    if spec.family is not None:
                        self._memo.clear()
                    return True
        return False

    def _family_bet_open(self) -> bool:
        """A family kernel of this region is compiling, or installed without its early
        probation samples yet (Note [Probation]): the next family waits for that verdict
        (gnn compiled four family kernels, 2.3-5x the interpreter each, before the first
        verdict; a verdict lowers the region's speed-up estimate, so after a clear loss
        the policy stops promoting). Exact promotions do not wait, nor does anything
        where no verdict will come (probation off: a fleet's compile service, which never
        runs a kernel; there the bet only queued each family behind the last one's
        compile, 1.5-1.8 s at N = 1000 in bench.fleet_sim)."""
        if not self.engine.config.probation:
            return False
        if any(isinstance(key, str) for key in self.pending):   # family keys are text
            return True
        return any(spec.probation is not None and len(spec.probation.ratios) < EARLY_SAMPLES
                   for spec in self.family_kernels.values())

    def _backing_off(self, key) -> bool:
        failed = self.counters.failed.get(key)
        return failed is not None and self.region_calls() < failed[0]

    def region_calls(self) -> int:
        """The region's calls through this slot, interpreted and specialized."""
        # The back-off counts region calls, not profiled ones: sampled watching (Note
        # [Sampled watching]) profiles a fraction of them.
        return self.counters.interpreted + self.counters.specialized

    def age(self) -> int:
        """The region's calls so far, detached ones included (as program calls): the
        horizon of Note [Rent or buy] in jit.policy."""
        return self.region_calls() + self.engine.detached_program_calls(self.region.index)

    def _match_family(self, signature: tuple) -> Specialization | None:
        """Find a family kernel whose bounds hold `signature` (once per new signature:
        the answer, a kernel or None, is memoized, so the next call is one dict lookup;
        installing a family kernel forgets the misses)."""
        found = None
        for spec in list(self.family_kernels.values()):
            if spec.family.contains(signature):
                found = spec
                break
        if len(self._memo) >= _MEMO_LIMIT:
            self._memo.clear()
        self._memo[signature] = found
        return found

    def _family_hit(self, signature: tuple, spec: Specialization) -> None:
        hits = self._family_hits.get(signature, _NO_HITS)[0] + 1
        if len(self._family_hits) >= _MEMO_LIMIT and hits == 1:
            self._family_hits.clear()
        self._family_hits[signature] = (hits, self._clock)   # the clock: Note [Settled]
        note_served(spec, signature)   # Note [Eviction by what a kernel still serves]
        if not tier_check_due(hits, self.threshold):
            return
        with self._lock:
            if signature in self.pending or signature in self.strong or \
                    self._backing_off(signature) or not self.engine.compiles_locally():
                return
            benefit, cost = exact_benefit(self, hits, spec)
            if benefit <= cost:
                return
            self.pending.add(signature)
            self.counters.promotions += 1
        self.engine.promote(self, signature, Decision(True, hits, self.threshold, benefit,
                                                      cost))

    # -- helpers ---------------------------------------------------------------------

    def _guard_failed(self, signature: tuple) -> None:
        counters = self.counters
        counters.guard_failures += 1
        # The 1st, (rate+1)th, ... failures are explained; with rate 1, every one.
        if (counters.guard_failures - 1) % self.engine.config.guard_failure_sample_rate:
            return
        # Explain against the most recently used specialization: the likeliest intent.
        candidates = [s for s in self.installed() if s.family is None]
        if not candidates:
            return
        latest = max(candidates, key=lambda s: s.last_used)
        actual = signature if latest.strength is GuardStrength.STRONG else weak_of(signature)
        counters.last_guard_failure = first_failure(self.live_in, latest.guard_key, actual,
                                                    latest.strength)
        self.engine.on_guard_failure(self, counters.last_guard_failure)

    def installed(self) -> list[Specialization]:
        """The specializations in this slot's tables."""
        return [*self.strong.values(), *self.weak.values(), *self.family_kernels.values()]

    def _tables(self):
        return (self.strong, self.weak, self.family_kernels)

    def install(self, spec: Specialization, pending_key=None) -> None:
        """`pending_key`: the key the target was marked pending under, when it differs
        from the installed target (a family clipped to the declared ranges)."""
        pending = spec.target if pending_key is None else pending_key
        spec.promoted_as = pending
        config = self.engine.config
        if config.probation and not self._writes_state:
            spec.probation = Probation(config.probation_shadow_every,
                                       config.probation_samples, config.probation_margin,
                                       early_unspaced=spec.family is not None)
        with self._lock:   # a back-off's count stays: a dropped key's next backs off 2x
            self.pending.discard(pending)
            if spec.family is not None:
                table, key = self.family_kernels, spec.family.key
                self._memo.clear()  # signatures it covers may be memoized as misses
            elif spec.strength is GuardStrength.STRONG:
                table, key = self.strong, spec.guard_key
            else:
                table, key = self.weak, spec.guard_key
            self._clock += 1
            spec.last_used = self._clock
            spec.installed_at = self.counters.interpreted + self.counters.specialized
            table[key] = spec
            self._tables_changed()  # layouts resolved as misses may hit now
            limit = self.engine.config.max_specializations_per_region
            while sum(len(t) for t in self._tables()) > limit:
                self._evict_one()

    def _evict_one(self) -> None:
        # Note [Eviction by what a kernel still serves]
        table, key = eviction_victim(self._tables(), self.strong)
        evicted = table.pop(key)
        self._tables_changed()
        if evicted.family is not None:
            self._memo.clear()  # it may point at the evicted kernel
        self.counters.evictions += 1
        self.engine.on_evict(self, evicted)

    def compile_failed(self, target) -> None:
        key = getattr(target, "key", target)
        with self._lock:
            self.pending.discard(key)
            _, failures = self.counters.failed.get(key, (0, 0))
            backoff = self.engine.config.failed_compile_backoff_calls * (2 ** failures)
            self.counters.failed[key] = (self.region_calls() + backoff, failures + 1)

    def compiles_locally(self) -> bool:
        """Whether promotions are decided here (the watch asks; Note [Fleet hooks])."""
        return self.engine.compiles_locally()

    def detach(self, period: int) -> None:
        """The watch found the slot not worth keeping (Note [Detached regions])."""
        self.engine.detach(self, period)

    def reattached(self) -> None:
        """The engine put this slot back (Note [Detached regions])."""
        self.watch.reattached()

    def forget_pending(self, target) -> None:
        with self._lock:
            self.pending.discard(getattr(target, "key", target))

