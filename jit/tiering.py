"""Tier 2 and the region's cap: when a family member's exact promotion is weighed
(Note [Tier-2 checks]) and which specialization leaves a full region (Note [Eviction by
what a kernel still serves]). Pure functions over a region's tables; dynvm.jit.region_jit
calls them holding its lock."""

from __future__ import annotations

from dynvm.jit.policy import EXACT, horizon

TIER_CHECK_EVERY = 32
SERVED_LIMIT = 64   # signatures a family kernel remembers serving; past it, "many"

# Note [Tier-2 checks]
# ~~~~~~~~~~~~~~~~~~~~
# A signature served by a family kernel is weighed for its exact kernel (Note [Tiering]
# in jit.region_jit) at its K-th family hit (K: the region's recurrence threshold, the
# recurrence an exact promotion from the interpreter needs), at 2K and 4K, and then every
# TIER_CHECK_EVERY hits. Checked only every TIER_CHECK_EVERY hits, a shape that recurs
# once per rotation of 16 reached its exact kernel 32 rotations after its family's: in
# BERT-base width's bench (16 shapes, 4 layers, K = 7), bf16 seasoning ended `settled`
# at round 14 with 12 of 16 shapes on family kernels (any-rows primitives, 1.10-1.17x
# the exact kernels), and the exact promotions came at rounds 33-40, each with a benefit
# already 2-9x its compile cost (each promotion's decision logged, 2026-12-05 22:50 UTC;
# fp32 the same, hidden by the 200-call warm-up before its seasoning). Nothing about bf16 made it
# slower: the savings estimate and the compile cost passed at the first check; the
# check came late. At K hits the shape has recurred as often as any promotion asks, so
# it is weighed then (benefit against compile, as before); the doubling spacing keeps a
# shape that does not pay yet from being weighed on every hit (the check takes the
# region's lock on the call's thread), and no check promotes more than its own shape:
# the compiles still queue one at a time, highest benefit first, behind the calls.


def tier_check_due(hits: int, threshold: int) -> bool:
    """Whether a family member's `hits`-th family hit weighs its exact kernel (Note
    [Tier-2 checks]); `threshold`: the region's K."""
    if hits >= TIER_CHECK_EVERY:
        return hits % TIER_CHECK_EVERY == 0
    threshold = max(1, threshold)
    if hits < threshold or hits % threshold:
        return False
    multiple = hits // threshold
    return multiple & (multiple - 1) == 0


def exact_benefit(region_jit, hits: int, spec) -> tuple[float, float]:
    """(benefit, compile cost) of the exact kernel of a signature with `hits` hits of
    family kernel `spec` in `region_jit` (Note [Tiering] in jit.region_jit: frequency x
    family-kernel time x `exact_over_family_gain` over the horizon)."""
    config = region_jit.engine.config
    frequency = hits / max(1, region_jit.region_calls() - spec.installed_at)
    benefit = (frequency * horizon(config, region_jit.age()) * spec.seconds
               / max(1, spec.calls) * config.exact_over_family_gain)
    return benefit, region_jit.engine.estimated_compile_seconds(len(region_jit.region), EXACT)


def note_served(spec, signature: tuple) -> None:
    """Remember that family kernel `spec` served `signature` (bounded: past SERVED_LIMIT
    signatures the kernel counts as serving many)."""
    served = spec.served
    if signature not in served and len(served) < SERVED_LIMIT:
        served.add(signature)


# Note [Eviction by what a kernel still serves]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A region holds at most `max_specializations_per_region` kernels. Least recently used
# alone misjudges family kernels: in a rotation of shapes, a family that is the only
# kernel of a shape without its exact one yet is as recently used as that shape, so it
# can be the LRU entry when an exact kernel of another shape arrives, and its shapes
# then run the interpreter until it is promoted and installed again. And a family all
# of whose served shapes have their exact kernels serves no call at all, though LRU may
# keep it over a kernel in use. So a full region evicts, least recently used first
# within each rank:
#   0. a family kernel every signature of which it served has an exact kernel (dead);
#   1. exact and weak kernels, and families not known to serve anything yet;
#   2. a family kernel that is still the only kernel of a signature it served (the
#      fallback: its loss sends those calls to the interpreter).
# The cap itself is right as a bound of a region's memory (packed weights, arenas and
# oneDNN primitives per kernel): in BERT-base width's 16 shapes the steady state is the
# 16 exact kernels, the 5 families evicted once each is dead; a new shape of a dead
# family's bucket then runs the interpreter until its family is promoted again, which
# reinstalls the compiled future (jit.queue keeps finished ones) instead of compiling.


def eviction_rank(spec, strong: dict) -> int:
    """The rank of `spec` in Note [Eviction by what a kernel still serves]."""
    if spec.family is None or not spec.served:
        return 1
    if len(spec.served) >= SERVED_LIMIT:
        return 2
    return 2 if any(signature not in strong for signature in spec.served) else 0


def eviction_victim(tables, strong: dict):
    """(table, key) of the specialization to evict from a full region's `tables`."""
    ranked = [(eviction_rank(spec, strong), spec.last_used, id(spec), key, table)
              for table in tables for key, spec in table.items()]
    *_, key, table = min(ranked, key=lambda entry: entry[:3])
    return table, key
