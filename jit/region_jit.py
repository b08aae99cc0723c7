"""One region's JIT state: its specializations behind guards, its profile, its slot.

`RegionJit` implements the VM's `RegionSlot` (dynvm.vm.slots). On entry it builds the
strong signature of the live-ins (about a microsecond per tensor), looks it up (the
lookup is the strong guard: see Note [Guard strength]), then the weak signature if the
region has weak specializations. A hit runs the specialization; a miss or a guard
failure hands the region back to the interpreter, which times it and calls `leave`,
where the signature is recorded and maybe promoted.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from dynvm.jit.policy import decide, recurrence_threshold
from dynvm.jit.profiler import RegionProfile
from dynvm.jit.signature import (
    GuardStrength,
    first_failure,
    strong_signer,
    weak_of,
    weak_signer,
)


@dataclass
class Specialization:
    signature: tuple
    strength: GuardStrength
    fn: object
    artifact: object
    calls: int = 0
    seconds: float = 0.0
    last_used: int = 0

    @property
    def guard_key(self) -> tuple:
        return self.signature if self.strength is GuardStrength.STRONG else weak_of(
            self.signature)


@dataclass
class RegionCounters:
    interpreted: int = 0
    specialized: int = 0
    guard_failures: int = 0
    deopts: int = 0
    evictions: int = 0
    promotions: int = 0
    last_guard_failure: str | None = None
    failed: dict = field(default_factory=dict)   # signature -> (retry at call, failures)


class RegionJit:
    def __init__(self, engine, region) -> None:
        self.engine = engine
        self.region = region
        self.live_in = tuple(r.index for r in region.live_in)
        self._sign = strong_signer(self.live_in)
        self._weak_sign = weak_signer(self.live_in)
        self.strong: dict[tuple, Specialization] = {}
        self.weak: dict[tuple, Specialization] = {}
        self.profile = RegionProfile(engine.config.window)
        self.threshold = recurrence_threshold(engine.config, len(region))
        self.pending: set[tuple] = set()
        self.counters = RegionCounters()
        self._lock = threading.Lock()
        self._clock = 0
        self._clock_fn = time.perf_counter

    # -- RegionSlot --------------------------------------------------------------------

    def enter(self, regs: list):
        signature = self._sign(regs)
        spec = self.strong.get(signature)
        if spec is None and self.weak:
            spec = self.weak.get(self._weak_sign(regs))
        if spec is not None:
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
            return None
        if self.strong or self.weak:
            self._guard_failed(signature)
        return signature

    def leave(self, signature: tuple, seconds: float) -> None:
        with self._lock:
            self.counters.interpreted += 1
            stats = self.profile.record(signature, seconds)
            if signature in self.pending or signature in self.strong:
                return
            failed = self.counters.failed.get(signature)
            if failed is not None and self.profile.calls < failed[0]:
                return
            decision = decide(self.engine.config, self.profile.recurrence(signature),
                              self.threshold, stats.mean_seconds, self.speedup(),
                              self.engine.estimated_compile_seconds(len(self.region)))
            if not decision.promote:
                return
            self.pending.add(signature)
            self.counters.promotions += 1
        self.engine.promote(self, signature, decision)

    # -- helpers ---------------------------------------------------------------------

    def _guard_failed(self, signature: tuple) -> None:
        counters = self.counters
        counters.guard_failures += 1
        # The 1st, (rate+1)th, ... failures are explained; with rate 1, every one.
        if (counters.guard_failures - 1) % self.engine.config.guard_failure_sample_rate:
            return
        # Explain against the most recently used specialization: the likeliest intent.
        candidates = list(self.strong.values()) + list(self.weak.values())
        if not candidates:
            return
        latest = max(candidates, key=lambda s: s.last_used)
        actual = signature if latest.strength is GuardStrength.STRONG else weak_of(signature)
        counters.last_guard_failure = first_failure(self.live_in, latest.guard_key, actual,
                                                    latest.strength)
        self.engine.on_guard_failure(self, counters.last_guard_failure)

    def speedup(self) -> float:
        """Measured fraction of interpreted time the region's specializations save."""
        savings = []
        for spec in list(self.strong.values()) + list(self.weak.values()):
            stats = self.profile.table.get(spec.signature)
            if spec.calls >= 8 and stats is not None and stats.mean_seconds > 0:
                savings.append(1.0 - (spec.seconds / spec.calls) / stats.mean_seconds)
        if not savings:
            return self.engine.config.expected_speedup
        return min(0.95, max(0.01, sum(savings) / len(savings)))

    def install(self, spec: Specialization) -> None:
        with self._lock:
            self.pending.discard(spec.signature)
            self.counters.failed.pop(spec.signature, None)
            table = self.strong if spec.strength is GuardStrength.STRONG else self.weak
            self._clock += 1
            spec.last_used = self._clock
            table[spec.guard_key] = spec
            limit = self.engine.config.max_specializations_per_region
            while len(self.strong) + len(self.weak) > limit:
                self._evict_one()

    def _evict_one(self) -> None:
        everything = [(s.last_used, id(s), key, table)
                      for table in (self.strong, self.weak) for key, s in table.items()]
        _, _, key, table = min(everything)
        del table[key]
        self.counters.evictions += 1

    def compile_failed(self, signature: tuple) -> None:
        with self._lock:
            self.pending.discard(signature)
            _, failures = self.counters.failed.get(signature, (0, 0))
            backoff = self.engine.config.failed_compile_backoff_calls * (2 ** failures)
            self.counters.failed[signature] = (self.profile.calls + backoff, failures + 1)

    def forget_pending(self, signature: tuple) -> None:
        with self._lock:
            self.pending.discard(signature)
