"""`Jit.stats()`: the JIT's counters, typed once: `JitStats`, with a `RegionStats` per
region, built from the engine's `EngineCounters`, its regions' counters, its queue and
its detached regions (`JitStats.from_engine`).

`Jit.stats()` answers `JitStats.to_dict()`, the plain dict callers have always read.
dynvm._runtime_stats.RuntimeStats takes its JIT fields from `JitStats`'s fields (each
None while the JIT is off), so a field added here is a field there: nothing is kept in
step by hand (docs/ARCHITECTURE.md, Conventions 13).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from dynvm.vm.errors import DynvmError


class StatsFormatError(DynvmError, ValueError):
    """A stats document (`RuntimeStats.to_dict()`'s form, e.g. from a replica's /stats)
    lacks a field or has one of the wrong kind; the message names it."""


@dataclass
class EngineCounters:
    """The engine's own counters (`Jit.counters`), bumped under its lock; `JitStats`
    reports them with the regions' and the queue's."""

    compiles: int = 0
    """Specializations compiled here."""
    compile_seconds: float = 0.0
    """Seconds spent compiling (waits for calls left out)."""
    family_compiles: int = 0
    """Of the compiles, code-family kernels."""
    compile_failures: int = 0
    """Compiles that failed."""
    specialize_failures: dict[str, int] = field(default_factory=dict)
    """Specializer failures by reason (Note [Failure accounting])."""
    specialize_rejections: int = 0
    """Signatures the program's own input checks reject."""
    prewarm_seconds: float = 0.0
    """First runs on the compile thread (Note [Prewarmed installs]): not in
    compile_seconds."""
    installs: int = 0
    """Specializations installed from another process."""
    install_seconds: float = 0.0
    """Seconds spent installing them."""
    install_rejections: int = 0
    """Records whose guard does not hash to the key they were stored under."""
    triton_compiles: int = 0
    """Compiles by the Triton backend."""
    triton_fallbacks: int = 0
    """Triton compiles that fell back to the CPU backend."""


@dataclass(frozen=True)
class RegionStats:
    """One region's JIT figures (`RuntimeStats.regions`)."""

    calls: int
    """Entries of the region, specialized and interpreted."""
    hit_rate: float
    """Share of those entries that ran specialized code."""
    specializations: int
    """Exact and weak specializations installed now."""
    family_kernels: int
    """Code-family kernels installed now."""
    guard_failures: int
    """Entries whose signature no installed guard accepted."""
    deopts: int
    """Specialized runs that failed and fell back to the interpreter."""
    last_guard_failure: str | None
    """The latest guard failure's first failing check, None before any."""
    detached: bool
    """Whether the region is detached now (Note [Detached regions])."""
    sample_every: int
    """Entries per watched entry (Note [Sampled watching])."""
    watch_cost_seconds: float
    """What watching one entry costs, as measured at the region's last check (its
    profiled misses' median, plus a layout key; a prior before any check)."""
    detached_program_calls: int
    """Program calls that ran while the region was detached."""
    extra: Mapping[str, object] = field(default_factory=dict)
    """Keys the engine reported that have no field here (should stay empty)."""

    def to_dict(self) -> dict:
        """The JSON form: one key per field, then `extra`'s keys."""
        return to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> RegionStats:
        """The RegionStats of `to_dict()`'s form (StatsFormatError when a field lacks)."""
        return from_dict(cls, data, "region")


@dataclass(frozen=True)
class JitStats:
    """The JIT engine's counters and per-region figures. Every field is a field of
    RuntimeStats too (None there while the JIT is off)."""

    interpreted_region_calls: int
    """Region entries the interpreter ran."""
    specialized_region_calls: int
    """Region entries that ran specialized code."""
    promotions: int
    """Signatures the policy promoted."""
    compiles: int
    """Specializations compiled."""
    family_compiles: int
    """Of those, code-family kernels."""
    compile_seconds: float
    """Seconds spent compiling."""
    compile_failures: int
    """Compiles that failed."""
    specialize_failures: Mapping[str, int]
    """Specializer failures by reason (Note [Failure accounting]: a dynvm bug if any)."""
    specialize_failures_total: int
    """Their sum."""
    specialize_rejections: int
    """Regions the specializer declined (expected, not failures)."""
    probation: Mapping[str, int]
    """Probation counters: shadow_calls, confirmed, demotions, drops."""
    installs: int
    """Specializations installed from another process (portable records)."""
    install_seconds: float
    """Seconds spent installing them."""
    install_rejections: int
    """Records refused at install."""
    compiles_locally: bool
    """Whether this runtime compiles (False when a fleet compiles for it)."""
    backend: str
    """The JIT's code generator ("cpu" or "triton")."""
    triton_compiles: int
    """Compiles by the Triton backend."""
    triton_fallbacks: int
    """Triton compiles that fell back to the CPU backend."""
    queue_length: int
    """Compile tasks waiting."""
    compile_timeouts: int
    """Compiles abandoned past their timeout."""
    dropped_tasks: int
    """Compile tasks dropped because the queue was full."""
    arena: Mapping[str, int] | None
    """The arena pool's ArenaPool.stats() (reserved_bytes, in_use_bytes, ...), None
    without a pool."""
    guard_failures: int
    """Guard failures over all regions."""
    deopts: int
    """Deoptimizations over all regions."""
    evictions: int
    """Specializations evicted from full caches."""
    cold_periods: int
    """Regions' periods without a promotion (Note [Cold regions])."""
    detached_regions: int
    """Regions detached now (Note [Detached regions])."""
    detachments: int
    """Detachments so far."""
    reattachments: int
    """Re-attachments so far."""
    detached_program_calls: int
    """Program calls that ran with some region detached, over all regions."""
    regions: Mapping[int, RegionStats]
    """Per-region figures, by region index."""

    def to_dict(self) -> dict:
        """The JSON form (what `Jit.stats()` returns): a key per field, regions keyed by
        index. A fresh dict."""
        data = to_dict(self)
        data["regions"] = {index: r.to_dict() for index, r in self.regions.items()}
        return data

    @classmethod
    def from_engine(cls, jit) -> JitStats:
        """Totals over the regions, the engine's counters, and per region its figures."""
        regions = {}
        counters, detaching = jit.counters, jit.detaching
        totals = dict.fromkeys(("interpreted", "specialized", "guard_failures", "deopts",
                                "evictions", "promotions", "cold_periods"), 0)
        for index, region_jit in jit.regions.items():
            c = region_jit.counters
            calls = c.interpreted + c.specialized
            regions[index] = RegionStats(
                calls=calls, hit_rate=c.specialized / calls if calls else 0.0,
                specializations=len(region_jit.strong) + len(region_jit.weak),
                family_kernels=len(region_jit.family_kernels),
                guard_failures=c.guard_failures, deopts=c.deopts,
                last_guard_failure=c.last_guard_failure,
                detached=index in detaching,
                sample_every=region_jit.watch.sample_every,   # Note [Sampled watching]
                watch_cost_seconds=region_jit.watch.watch_cost_seconds,
                detached_program_calls=detaching.program_calls_of(index))
            for name in totals:
                totals[name] += getattr(c, name)
        return cls(
            interpreted_region_calls=totals["interpreted"],
            specialized_region_calls=totals["specialized"],
            promotions=totals["promotions"],
            compiles=counters.compiles,
            family_compiles=counters.family_compiles,
            compile_seconds=counters.compile_seconds,
            compile_failures=counters.compile_failures,
            # Note [Failure accounting]: the first two must be zero on every model.
            specialize_failures=dict(counters.specialize_failures),
            specialize_failures_total=sum(counters.specialize_failures.values()),
            specialize_rejections=counters.specialize_rejections,
            probation=jit.probation_counters.as_dict(),
            installs=counters.installs,
            install_seconds=counters.install_seconds,
            install_rejections=counters.install_rejections,
            compiles_locally=jit.compiles_locally(),
            backend=jit.backend,
            triton_compiles=counters.triton_compiles,
            triton_fallbacks=counters.triton_fallbacks,
            queue_length=len(jit.queue),
            compile_timeouts=jit.queue.timed_out,
            dropped_tasks=jit.queue.dropped,
            arena=jit.arena_pool.stats() if jit.arena_pool is not None else None,
            guard_failures=totals["guard_failures"],
            deopts=totals["deopts"],
            evictions=totals["evictions"],
            cold_periods=totals["cold_periods"],
            # Note [Detached regions]: detached now, detachments and re-attachments.
            detached_regions=len(detaching),
            detachments=detaching.detachments,
            reattachments=detaching.reattachments,
            detached_program_calls=sum(detaching.program_calls_of(i) for i in jit.regions),
            regions=regions)


def jit_stats(jit) -> dict:
    """`Jit.stats()`: the engine's `JitStats` in its dict form."""
    return JitStats.from_engine(jit).to_dict()


# -- the JSON form, shared with dynvm._runtime_stats ------------------------------------

def to_dict(stats, skip=lambda name, value: False) -> dict:
    """A stats dataclass's JSON form: a key per field (mappings copied) unless `skip`,
    then the keys of its `extra`, when it has one."""
    data = {}
    for f in fields(stats):
        value = getattr(stats, f.name)
        if f.name != "extra" and not skip(f.name, value):
            data[f.name] = dict(value) if isinstance(value, Mapping) else value
    data.update(getattr(stats, "extra", {}))
    return data


def from_dict(cls, data: Mapping, what: str):
    """The `cls` of a JSON form: keys without a field go to its `extra`; a required
    field that lacks is a StatsFormatError naming it."""
    if not isinstance(data, Mapping):
        raise StatsFormatError(f"{what}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in fields(cls)} - {"extra"}
    known = {key: value for key, value in data.items() if key in names}
    extra = {key: value for key, value in data.items() if key not in names}
    try:
        return cls(**known, extra=extra)
    except TypeError as exc:  # a required field lacks
        raise StatsFormatError(f"{what}: {exc}") from None
