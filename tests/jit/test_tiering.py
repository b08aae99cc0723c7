"""Tier 2 and the region's cap, on a real program (no mocks): a family member reaches its
exact kernel at its K-th family hit (Note [Tier-2 checks] in dynvm.jit.tiering); a full
region evicts a family that serves nothing before a kernel in use, and never the family
that is the only kernel of a shape without its exact one (Note [Eviction by what a
kernel still serves])."""

from __future__ import annotations

import pytest

import dynvm
from dynvm.jit.tiering import TIER_CHECK_EVERY, tier_check_due
from tests.jit.test_families_arenas import (
    HIDDEN,
    SEQ,
    check,
    eager,
    family_config,
    family_kernel,
    one_thread,  # noqa: F401 — the autouse fixture of that module, here too
    region,
    small,  # noqa: F401 — the module-scoped program fixture
    strong_dims,
    warm_family,
    x_of,
)


def test_tier_check_schedule_starts_at_k_and_doubles():
    due = [hits for hits in range(1, 100) if tier_check_due(hits, 7)]
    assert due == [7, 14, 28, 32, 64, 96]
    assert [h for h in range(1, 40) if tier_check_due(h, 2)] == [2, 4, 8, 16, 32]
    # K past TIER_CHECK_EVERY (a config with a wide window): the every-32 checks alone.
    assert [h for h in range(1, 70) if tier_check_due(h, 40)] == [32, 64]
    assert not tier_check_due(0, 2)


def test_rotating_members_reach_exact_kernels_after_k_family_hits(small):  # noqa: F811
    """Four members of one family in rotation, as a bench rotates its shapes: each one
    gets its exact kernel once it has hit the family K times (before: only at its 32nd
    family hit, so a rotation of 16 shapes waited 32 rounds)."""
    dm, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config(exact_over_family_gain=1.0))
    family = warm_family(rt)
    k = region(rt).threshold
    assert 2 * k < TIER_CHECK_EVERY, k
    members = (20, 30, 40, 50)
    inputs = {b: x_of(b, seed=b) for b in members}
    for _ in range(k):
        for b in members:
            rt(inputs[b])
    exact = strong_dims(rt)
    assert set(exact) == {(b, SEQ, HIDDEN) for b in members}, (k, sorted(exact))
    assert all(spec.family is None for spec in exact.values())
    assert rt.stats()["compiles"] == 1 + len(members)
    for b in members:   # served by their exact kernels now, not the family
        calls = family.calls
        check(rt(inputs[b]), eager(dm.module, inputs[b]), f"batch {b}")
        assert family.calls == calls


def hit(rt, batch: int, times: int) -> None:
    x = x_of(batch, seed=batch)
    for _ in range(times):
        rt(x)


def test_full_region_evicts_a_family_that_serves_nothing_first(small):  # noqa: F811
    """Cap 3: the family, the exact kernels of the two members it served, then a lone
    shape's exact kernel. The family is dead (both its shapes have exact kernels):
    it goes, not the least recently used exact kernel (batch 20's)."""
    _, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config(exact_over_family_gain=1.0,
                                                  max_specializations_per_region=3))
    family = warm_family(rt)
    k = region(rt).threshold
    hit(rt, 20, k)
    hit(rt, 30, k)
    assert set(strong_dims(rt)) == {(20, SEQ, HIDDEN), (30, SEQ, HIDDEN)}
    assert family_kernel(rt) is family
    hit(rt, 3, k + 1)   # alone in its bucket (2..4): an exact kernel directly
    assert set(strong_dims(rt)) == {(20, SEQ, HIDDEN), (30, SEQ, HIDDEN), (3, SEQ, HIDDEN)}
    assert not region(rt).family_kernels
    assert rt.stats()["evictions"] == 1


def test_full_region_keeps_the_family_that_is_a_shapes_only_kernel(small):  # noqa: F811
    """Cap 2: the family serves batch 25 (no exact kernel), then two lone shapes get
    exact kernels. The family is the least recently used, but evicting it would send
    batch 25 back to the interpreter: the older exact kernel goes instead."""
    dm, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config(exact_over_family_gain=1e-9,
                                                  max_specializations_per_region=2))
    family = warm_family(rt)
    k = region(rt).threshold
    hit(rt, 25, k)   # served by the family; no tier-up (the exact kernel would not pay)
    assert not strong_dims(rt)
    hit(rt, 3, k + 1)
    hit(rt, 8, k + 1)   # bucket 5..16, alone too
    assert family_kernel(rt) is family
    assert set(strong_dims(rt)) == {(8, SEQ, HIDDEN)}
    assert rt.stats()["evictions"] == 1
    x = x_of(25, seed=25)
    calls, interpreted = family.calls, rt.stats()["interpreted_region_calls"]
    check(rt(x), eager(dm.module, x), "batch 25 after the eviction")
    assert family.calls == calls + 1
    assert rt.stats()["interpreted_region_calls"] == interpreted


@pytest.mark.parametrize("hits", [1, 5])
def test_no_check_before_k_hits(hits):
    assert not tier_check_due(hits, 6)
