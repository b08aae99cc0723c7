"""`Jit.stats()`: the JIT's counters as the plain dict that `Runtime.stats()` types
(dynvm._runtime_stats.RuntimeStats; a key added here needs its field there)."""

from __future__ import annotations


def jit_stats(jit) -> dict:
    """Totals over the regions, the engine's counters, and per region its figures."""
    regions = {}
    totals = {"interpreted": 0, "specialized": 0, "guard_failures": 0, "deopts": 0,
              "evictions": 0, "promotions": 0, "cold_periods": 0}
    for index, region_jit in jit.regions.items():
        c = region_jit.counters
        calls = c.interpreted + c.specialized
        regions[index] = {
            "calls": calls, "hit_rate": c.specialized / calls if calls else 0.0,
            "specializations": len(region_jit.strong) + len(region_jit.weak),
            "family_kernels": len(region_jit.family_kernels),
            "guard_failures": c.guard_failures, "deopts": c.deopts,
            "last_guard_failure": c.last_guard_failure,
            "detached": index in jit.detached,
            "sample_every": region_jit.sample_every,   # Note [Sampled watching]
            "watch_cost_seconds": region_jit.watch_cost_seconds,
            "detached_program_calls": jit.detached_program_calls(index),
        }
        for name in totals:
            totals[name] += getattr(c, name)
    return {
        "interpreted_region_calls": totals["interpreted"],
        "specialized_region_calls": totals["specialized"],
        "promotions": totals["promotions"],
        "compiles": jit.compiles,
        "family_compiles": jit.family_compiles,
        "compile_seconds": jit.compile_seconds,
        "compile_failures": jit.compile_failures,
        # Note [Failure accounting]: the first two must be zero on every model.
        "specialize_failures": dict(jit.specialize_failures),
        "specialize_failures_total": sum(jit.specialize_failures.values()),
        "specialize_rejections": jit.specialize_rejections,
        "probation": jit.probation_counters.as_dict(),
        "installs": jit.installs,
        "install_seconds": jit.install_seconds,
        "install_rejections": jit.install_rejections,
        "compiles_locally": jit.compiles_locally(),
        "backend": jit.backend,
        "triton_compiles": jit.triton_compiles,
        "triton_fallbacks": jit.triton_fallbacks,
        "queue_length": len(jit.queue),
        "compile_timeouts": jit.queue.timed_out,
        "dropped_tasks": jit.queue.dropped,
        "arena": jit.arena_pool.stats() if jit.arena_pool is not None else None,
        "guard_failures": totals["guard_failures"],
        "deopts": totals["deopts"],
        "evictions": totals["evictions"],
        "cold_periods": totals["cold_periods"],
        # Note [Detached regions]: detached now, detachments and re-attachments so far.
        "detached_regions": len(jit.detached),
        "detachments": jit.detachments,
        "reattachments": jit.reattachments,
        "detached_program_calls": sum(jit.detached_program_calls(i)
                                      for i in jit.regions),
        "regions": regions,
    }
