"""`RuntimeStats`: what `Runtime.stats()` returns, typed (docs/ARCHITECTURE.md, Conventions 13).

The JIT engine reports its counters as a dict (`Jit.stats()`); the Runtime turns that,
with its own counters, into a `RuntimeStats` at its boundary, and everything above reads
attributes. `to_dict()` is the JSON form (what a replica's `/stats` route serves and
`dynvm top` reads; `from_dict` reads it back). A key the engine reports that has no
field here is kept in `extra` rather than lost, and tests/dynvm/test_runtime_stats.py
fails until it gets a field.

Note [Stats as a mapping]
~~~~~~~~~~~~~~~~~~~~~~~~~
Before it was typed, `stats()` returned the dict that `to_dict()` now builds, and many
tests and benchmarks read it by key (`stats["compiles"]`, `{**stats, ...}`). A
RuntimeStats is therefore also a read-only Mapping of its `to_dict()` form, so that
code keeps working; library code reads attributes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from functools import cached_property

from dynvm.vm.errors import DynvmError


class StatsFormatError(DynvmError, ValueError):
    """A stats document (`RuntimeStats.to_dict()`'s form, e.g. from a replica's /stats)
    lacks a field or has one of the wrong kind; the message names it."""


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
        return _to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> RegionStats:
        """The RegionStats of `to_dict()`'s form (StatsFormatError when a field lacks)."""
        return _from_dict(cls, data, "region")


# Fields of RuntimeStats the Runtime always reports; every other field (extra aside) is
# the JIT's, reported only when `jit` is true (to_dict leaves them out otherwise).
_RUNTIME_FIELDS = frozenset({
    "calls", "instructions_executed", "region_count", "instructions", "device", "jit",
    "jit_disabled_by", "allocations_per_forward", "telemetry_events_dropped"})
# Reported only when set (absent from the dict otherwise, as before the type existed).
_ONLY_WHEN_SET = frozenset({"jit_disabled_by", "telemetry_events_dropped"})


@dataclass(frozen=True)
class RuntimeStats(Mapping):
    """Counters of one Runtime since it was made: the runtime's own, and the JIT's when
    it is on (None when it is off). A read-only Mapping of `to_dict()` too (Note [Stats
    as a mapping])."""

    calls: int
    """Program calls."""
    instructions_executed: int
    """Instructions the interpreter executed (specialized regions count none)."""
    region_count: int
    """Regions of the program."""
    instructions: int
    """Instructions of the program."""
    device: str
    """The runtime's device."""
    jit: bool
    """Whether the JIT is on."""
    allocations_per_forward: int | None
    """Allocations of the latest call that counted them (count_allocations), else None."""
    jit_disabled_by: str | None = None
    """What turned the JIT off (an environment variable), None when nothing did."""
    interpreted_region_calls: int | None = None
    """Region entries the interpreter ran."""
    specialized_region_calls: int | None = None
    """Region entries that ran specialized code."""
    promotions: int | None = None
    """Signatures the policy promoted."""
    compiles: int | None = None
    """Specializations compiled."""
    family_compiles: int | None = None
    """Of those, code-family kernels."""
    compile_seconds: float | None = None
    """Seconds spent compiling."""
    compile_failures: int | None = None
    """Compiles that failed."""
    specialize_failures: Mapping[str, int] | None = None
    """Specializer failures by reason (Note [Failure accounting]: a dynvm bug if any)."""
    specialize_failures_total: int | None = None
    """Their sum."""
    specialize_rejections: int | None = None
    """Regions the specializer declined (expected, not failures)."""
    probation: Mapping[str, int] | None = None
    """Probation counters: shadow_calls, confirmed, demotions, drops."""
    installs: int | None = None
    """Specializations installed from another process (portable records)."""
    install_seconds: float | None = None
    """Seconds spent installing them."""
    install_rejections: int | None = None
    """Records refused at install."""
    compiles_locally: bool | None = None
    """Whether this runtime compiles (False when a fleet compiles for it)."""
    backend: str | None = None
    """The JIT's code generator ("cpu" or "triton")."""
    triton_compiles: int | None = None
    """Compiles by the Triton backend."""
    triton_fallbacks: int | None = None
    """Triton compiles that fell back to the CPU backend."""
    queue_length: int | None = None
    """Compile tasks waiting."""
    compile_timeouts: int | None = None
    """Compiles abandoned past their timeout."""
    dropped_tasks: int | None = None
    """Compile tasks dropped because the queue was full."""
    arena: Mapping[str, int] | None = None
    """The arena pool's ArenaPool.stats() (reserved_bytes, in_use_bytes, ...), None
    without a pool."""
    guard_failures: int | None = None
    """Guard failures over all regions."""
    deopts: int | None = None
    """Deoptimizations over all regions."""
    evictions: int | None = None
    """Specializations evicted from full caches."""
    cold_periods: int | None = None
    """Regions' periods without a promotion (Note [Cold regions])."""
    detached_regions: int | None = None
    """Regions detached now (Note [Detached regions])."""
    detachments: int | None = None
    """Detachments so far."""
    reattachments: int | None = None
    """Re-attachments so far."""
    detached_program_calls: int | None = None
    """Program calls that ran with some region detached, over all regions."""
    regions: Mapping[int, RegionStats] | None = None
    """Per-region figures, by region index."""
    telemetry_events_dropped: int | None = None
    """Span events the telemetry rate limit dropped, when it has one."""
    extra: Mapping[str, object] = field(default_factory=dict)
    """Keys the engine reported that have no field here (should stay empty)."""

    # -- figures derived from the counters (metrics and `dynvm top` show them) ------------

    @property
    def specialized_ratio(self) -> float | None:
        """Specialized region calls / all region calls; None before any or JIT off."""
        specialized, interpreted = self.specialized_region_calls, self.interpreted_region_calls
        if specialized is None or interpreted is None or specialized + interpreted == 0:
            return None
        return specialized / (specialized + interpreted)

    @property
    def installed_families(self) -> int | None:
        """Code-family kernels installed now, over all regions; None with the JIT off."""
        if self.regions is None:
            return None
        return sum(r.family_kernels for r in self.regions.values())

    @property
    def installed_specializations(self) -> int | None:
        """Exact and weak specializations installed now, over all regions."""
        if self.regions is None:
            return None
        return sum(r.specializations for r in self.regions.values())

    # -- JSON form -------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The JSON form: a key per field that is reported (the JIT's only when it is
        on), regions keyed by index, then `extra`'s keys. A fresh dict."""
        data = _to_dict(self, skip=lambda name, value: (
            (name in _ONLY_WHEN_SET and value is None)
            or (not self.jit and name not in _RUNTIME_FIELDS)))
        if "regions" in data and self.regions is not None:
            data["regions"] = {index: r.to_dict() for index, r in self.regions.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping) -> RuntimeStats:
        """The RuntimeStats of `to_dict()`'s form, or of its JSON (region indices as
        strings). Keys without a field go to `extra`; StatsFormatError when a field the
        runtime always reports lacks."""
        regions = data.get("regions") if isinstance(data, Mapping) else None
        if regions is not None:
            if not isinstance(regions, Mapping):
                raise StatsFormatError(f"stats: regions must be a mapping, got "
                                       f"{type(regions).__name__}")
            data = {**data, "regions": {_index(key): RegionStats.from_dict(value)
                                        for key, value in regions.items()}}
        return _from_dict(cls, data, "stats")

    # -- Note [Stats as a mapping] ------------------------------------------------------

    @cached_property
    def _as_dict(self) -> dict:
        return self.to_dict()

    def __getitem__(self, key: str):
        return self._as_dict[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._as_dict)

    def __len__(self) -> int:
        return len(self._as_dict)


def _index(key) -> int:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    raise StatsFormatError(f"stats: region index {key!r} is not an integer")


def _to_dict(stats, skip=lambda name, value: False) -> dict:
    data = {}
    for f in fields(stats):
        value = getattr(stats, f.name)
        if f.name != "extra" and not skip(f.name, value):
            data[f.name] = dict(value) if isinstance(value, Mapping) else value
    data.update(stats.extra)
    return data


def _from_dict(cls, data: Mapping, what: str):
    if not isinstance(data, Mapping):
        raise StatsFormatError(f"{what}: expected a mapping, got {type(data).__name__}")
    names = {f.name for f in fields(cls)} - {"extra"}
    known = {key: value for key, value in data.items() if key in names}
    extra = {key: value for key, value in data.items() if key not in names}
    try:
        return cls(**known, extra=extra)
    except TypeError as exc:  # a required field lacks
        raise StatsFormatError(f"{what}: {exc}") from None
