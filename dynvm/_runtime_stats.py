"""`RuntimeStats`: what `Runtime.stats()` returns, typed (docs/ARCHITECTURE.md, Conventions 13).

Its fields are the Runtime's own counters and, taken from dynvm.jit.engine_stats.JitStats
field by field, the JIT engine's (each None while the JIT is off): a counter the engine
adds to JitStats is a RuntimeStats field at once, with the docstring written there, and
nothing is kept in step by hand. The Runtime builds it from the engine's report at its
boundary (`RuntimeStats.of`, attribute by attribute), and everything above reads
attributes. `to_dict()` is the JSON form (what a
replica's `/stats` route serves and `dynvm top` reads; `from_dict` reads it back). A key
that has no field is kept in `extra` rather than lost, and tests/dynvm/test_runtime_stats.py
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
from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from functools import cached_property

from dynvm.jit.engine_stats import JitStats, RegionStats, StatsFormatError
from dynvm.jit.engine_stats import from_dict as _from_dict

__all__ = ["RegionStats", "RuntimeStats", "StatsFormatError", "field_of", "read"]

# The JIT's fields, as RuntimeStats has them: JitStats's, each optional (None with the
# JIT off) and keyword-only, so that they may precede the Runtime's required fields.
_JitFields = make_dataclass(
    "_JitFields",
    [(f.name, f"{f.type} | None", field(default=None, kw_only=True))
     for f in fields(JitStats)],
    frozen=True)
_JitFields.__doc__ = "RuntimeStats's JIT fields: dynvm.jit.engine_stats.JitStats's, optional."
_JitFields.__module__ = __name__
_JIT_FIELDS = tuple(f.name for f in fields(JitStats))
# Reported only when set (absent from the dict otherwise, as before the type existed).
_ONLY_WHEN_SET = frozenset({"jit_disabled_by", "telemetry_events_dropped"})


@dataclass(frozen=True)
class RuntimeStats(_JitFields, Mapping):
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
        data = {}
        for name in _KEY_ORDER:   # the order the keys had before the JIT's were derived
            value = getattr(self, name)
            if (name in _ONLY_WHEN_SET and value is None) or (
                    not self.jit and name in _JIT_FIELDS):
                continue
            data[name] = dict(value) if isinstance(value, Mapping) else value
        data.update(self.extra)
        if "regions" in data and self.regions is not None:
            data["regions"] = {index: r.to_dict() for index, r in self.regions.items()}
        return data

    @classmethod
    def of(cls, engine: JitStats | None, /, **runtime) -> RuntimeStats:
        """Built from the engine's JitStats (None with the JIT off), field by field, and
        the Runtime's own counters (`runtime`, by field name): no dict between them."""
        taken = {} if engine is None else {
            f.name: getattr(engine, f.name) for f in fields(JitStats)}
        return cls(**runtime, **taken)

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


# The Runtime's own fields, the JIT's, then the telemetry's count (where it always was).
_KEY_ORDER = (*(f.name for f in fields(RuntimeStats)
                if f.name not in _JIT_FIELDS + ("extra", "telemetry_events_dropped")),
              *_JIT_FIELDS, "telemetry_events_dropped")


def _index(key) -> int:
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isdigit():
        return int(key)
    raise StatsFormatError(f"stats: region index {key!r} is not an integer")


# -- reading a stats document through its type (dynvm top, dynvm.cluster.serving._metrics) -----

def field_of(kind: type, name: str) -> str:
    """`name`, once checked to be a field of the counters (or stats) dataclass `kind`;
    a reader names its keys through this, so a renamed field fails at import."""
    if name not in {f.name for f in fields(kind)}:
        raise AttributeError(f"{kind.__name__} has no field {name!r}")
    return name


def read(kind: type, stats: Mapping):
    """The `kind` counters (or RuntimeStats) in a stats document (a replica's /stats,
    whose keys are the field names), read tolerantly: a field that is absent or not a
    number reads as None, a container field keeps its default."""
    values = {}
    for f in fields(kind):
        if f.default_factory is not MISSING:   # a container (RuntimeStats.extra): its own
            continue
        value = stats.get(f.name) if isinstance(stats, Mapping) else None
        number = isinstance(value, int | float) and not isinstance(value, bool)
        values[f.name] = value if number else None
    return kind(**values)
