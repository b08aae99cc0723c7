"""Runtime.stats() is a typed RuntimeStats that loses nothing the JIT engine reports."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import torch

import dynvm
from dynvm._runtime_stats import RegionStats, RuntimeStats, StatsFormatError
from tests.jit._jit_helpers import compiled, eager_config

# Fields that may be None while the JIT is on (everything else must be reported).
MAY_BE_NONE = {"jit_disabled_by", "allocations_per_forward", "arena",
               "telemetry_events_dropped"}


@pytest.fixture(scope="module")
def jit_stats() -> RuntimeStats:
    with dynvm.Runtime(compiled("branchy"), jit=eager_config()) as runtime:
        for _ in range(4):
            runtime(torch.randn(3, 32))
        return runtime.stats()


def test_every_key_the_engine_reports_has_a_field(jit_stats):
    # A key the engine adds lands in `extra`: give it a field (with its docstring).
    assert jit_stats.extra == {}
    assert jit_stats.regions and all(r.extra == {} for r in jit_stats.regions.values())


def test_every_field_is_reported_while_the_jit_is_on(jit_stats):
    # A field the engine stopped reporting would stay None.
    unset = [f.name for f in fields(RuntimeStats)
             if getattr(jit_stats, f.name) is None and f.name not in MAY_BE_NONE]
    assert not unset, f"fields the runtime no longer reports: {unset}"
    assert jit_stats.compiles > 0 and jit_stats.calls == 4


def test_the_json_form_reads_back_as_the_same_stats(jit_stats):
    data = json.loads(json.dumps(jit_stats.to_dict()))
    assert set(data["regions"]) == {str(i) for i in jit_stats.regions}
    assert RuntimeStats.from_dict(data) == jit_stats


def test_derived_figures(jit_stats):
    specialized = jit_stats.specialized_region_calls
    assert jit_stats.specialized_ratio == pytest.approx(
        specialized / (specialized + jit_stats.interpreted_region_calls))
    assert jit_stats.installed_specializations == sum(
        r.specializations for r in jit_stats.regions.values()) > 0


def test_with_the_jit_off_only_the_runtime_reports():
    runtime = dynvm.Runtime(compiled("branchy"), jit=False)
    runtime(torch.randn(3, 32))
    stats = runtime.stats()
    assert (stats.calls, stats.jit, stats.compiles, stats.regions) == (1, False, None, None)
    assert set(stats.to_dict()) == {"calls", "instructions_executed", "region_count",
                                    "instructions", "device", "jit",
                                    "allocations_per_forward"}
    assert stats.specialized_ratio is None and stats.installed_families is None


def test_unknown_keys_are_kept_not_lost():
    data = {**_minimal(), "new_counter": 3,
            "regions": {"0": {**_region(), "new_region_counter": 1}}}
    stats = RuntimeStats.from_dict(data)
    assert stats.extra == {"new_counter": 3}
    assert stats.regions[0].extra == {"new_region_counter": 1}
    assert stats.to_dict()["new_counter"] == 3
    assert stats.to_dict()["regions"][0]["new_region_counter"] == 1


@pytest.mark.parametrize("edit, problem", [
    (lambda data: data.pop("instructions_executed"), "instructions_executed"),
    (lambda data: data.update(regions={"x": _region()}), "region index 'x' is not an integer"),
    (lambda data: data.update(regions={"0": [1]}), "region: expected a mapping, got list"),
])
def test_a_malformed_document_is_refused(edit, problem):
    data = _minimal()
    edit(data)
    with pytest.raises(StatsFormatError, match=problem):
        RuntimeStats.from_dict(data)
    with pytest.raises(StatsFormatError, match="expected a mapping, got list"):
        RuntimeStats.from_dict([data])


def test_it_reads_as_the_mapping_it_used_to_be(jit_stats):
    # Note [Stats as a mapping]
    assert jit_stats["compiles"] == jit_stats.compiles
    assert {**jit_stats}["regions"][0] == jit_stats.regions[0].to_dict()
    assert jit_stats.get("nope") is None and len(jit_stats) == len(jit_stats.to_dict())


def _minimal() -> dict:
    return {"calls": 0, "instructions_executed": 0, "region_count": 1, "instructions": 3,
            "device": "cpu", "jit": True, "allocations_per_forward": None}


def _region() -> dict:
    return RegionStats(calls=0, hit_rate=0.0, specializations=0, family_kernels=0,
                       guard_failures=0, deopts=0, last_guard_failure=None, detached=False,
                       sample_every=1, watch_cost_seconds=5e-6,
                       detached_program_calls=0).to_dict()


def test_dynvm_top_reads_runtime_stats_fields_by_their_names():
    # `dynvm top` reads the JSON form over HTTP; a renamed field must not leave it
    # reading a key that no longer exists.
    from dynvm import _top_cmd

    replica_counters = {"requests", "errors"}
    names = {f.name for f in fields(RuntimeStats)}
    assert set(_top_cmd._SUMMED) - replica_counters <= names
    assert "family_kernels" in {f.name for f in fields(RegionStats)}


def test_the_jits_fields_are_jit_stats_fields_not_a_copy(jit_stats):
    # RuntimeStats takes the JIT's fields from JitStats (nothing kept in step by hand):
    # each is there, optional, and what the engine reports is exactly JitStats's form.
    from dynvm.jit import engine_stats
    from dynvm.jit.engine_stats import JitStats

    by_name = {f.name: f for f in fields(RuntimeStats)}
    for f in fields(JitStats):
        assert by_name[f.name].default is None and by_name[f.name].kw_only, f.name
    assert RegionStats is engine_stats.RegionStats   # one class, not two
    reported = {f.name for f in fields(JitStats)}
    assert reported <= set(jit_stats.to_dict())
    off = RuntimeStats.from_dict({**_minimal(), "jit": False})
    assert not reported & set(off.to_dict())


def test_the_runtime_builds_its_stats_from_the_engines_types():
    # Runtime.stats() takes JitStats field by field (RuntimeStats.of); Jit.stats() is the
    # same JitStats as a dict, and reading that dict back gives the same RuntimeStats.
    from dynvm.jit.engine_stats import JitStats

    with dynvm.Runtime(compiled("branchy"), jit=eager_config()) as runtime:
        for _ in range(3):
            runtime(torch.randn(3, 32))
    # Closed: no background compile moves a counter between the three readings.
    typed, engine = runtime.stats(), runtime.jit.stats()
    assert JitStats.from_engine(runtime.jit).to_dict() == engine and typed.compiles > 0
    own = {k: v for k, v in typed.to_dict().items() if k not in engine}
    assert RuntimeStats.from_dict({**own, **engine}) == typed
