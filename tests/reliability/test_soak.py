"""Soak: 10,000 calls of the jitter workload (batch uniform over 1..64, seq 32) through
ONE Runtime with the JIT on (background compiles, families, arenas), with bounds set
small so that eviction and the arena budget are exercised rather than never reached.

Every 250 calls the runtime's caches are checked against their configured bounds; at
the end the resident set size is compared with its value after warm-up. Figures are
printed (pytest -s) for docs/RELIABILITY.md.

The model is the demo Transformer in a small configuration (1 layer, hidden 16) so the
run fits in well under a minute on 2 shared cores; the shapes, the op mix and the JIT's
work per call are those of the full model, only the arithmetic is smaller.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import torch
from torch.export import Dim

import dynvm
from dynvm.jit import region_jit
from dynvm.models import transformer
from dynvm.shape_cluster import FamilyIndex

pytestmark = pytest.mark.slow

CALLS = 10_000
WARMUP = 1_000
SEQ = 32
HIDDEN = 16
CHECK_EVERY = 250
RSS_LIMIT_BYTES = (50 + 50) * 2**20
"""Stated limit of resident-set growth from the end of warm-up to the last call: 50 MiB
for dynvm's own bounded caches and 50 MiB for oneDNN's primitive cache, an LRU of up to
1024 primitives (ONEDNN_PRIMITIVE_CACHE_CAPACITY) that fills over the soak's shapes. On
2026-12-03 the growth was 29-34 MiB with that cache off and 40-91 MiB with it on (seven
runs, this commit and stop 10's alike), so a 50 MiB limit failed at random. A leak of
10 KB a call (90 MiB over the 9,000 calls after warm-up, on top of those) fails it."""

CONFIG = dynvm.JitConfig(
    # Promote readily (a long-lived server: K=2, a long payback horizon), so that more
    # families qualify than a region may hold and the LRU bound is what limits them.
    min_recurrence=2,
    max_recurrence=2,
    horizon_calls=100_000,
    families=True,
    bucket_ratio=2,                     # batch 1..64 -> 7 families (1, 2, 3-4, ... 33-64)
    max_specializations_per_region=4,   # fewer than the families the jitter keeps using
    max_queue_length=4,
    arena_budget_bytes=1 << 20,         # 1 MiB: less than all arenas want at once
    compile_threads=1,
)
# The bounds the JIT's region tables and the family index keep by default.
MEMO_LIMIT = region_jit._MEMO_LIMIT
INDEX_MEMO_LIMIT = FamilyIndex()._memo_limit


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def check_bounds(runtime: dynvm.Runtime, seen: dict) -> None:
    stats = runtime.stats()
    limit = CONFIG.max_specializations_per_region
    for index, region in stats["regions"].items():
        held = region["specializations"] + region["family_kernels"]
        assert held <= limit, (index, region)
        seen["max_held"] = max(seen["max_held"], held)
    for rj in runtime.jit.regions.values():
        # Family memo, family index memo, tier-2 hit counts, shape profiles.
        assert len(rj._memo) <= MEMO_LIMIT
        assert rj.families.memo_size <= INDEX_MEMO_LIMIT
        assert len(rj._family_hits) <= MEMO_LIMIT
        assert len(rj.profile.table) <= 4 * CONFIG.window
        assert len(rj.family_profile.table) <= 4 * CONFIG.window
        seen["max_profile"] = max(seen["max_profile"], len(rj.profile.table))
    assert stats["queue_length"] <= CONFIG.max_queue_length
    seen["max_queue"] = max(seen["max_queue"], stats["queue_length"])
    arena = stats["arena"]
    assert arena["reserved_bytes"] <= CONFIG.arena_budget_bytes, arena
    seen["max_arena"] = max(seen["max_arena"], arena["reserved_bytes"])


def test_soak_jitter_stays_within_bounds():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 2 shared cores: intra-op threads would only contend
    try:
        demo = transformer(layers=1, hidden=HIDDEN, heads=2, ffn=32, max_batch=64,
                           max_seq=64)
        program = dynvm.compile(demo.module, (torch.randn(4, SEQ, HIDDEN),),
                                dynamic_shapes=({0: Dim("batch", min=1, max=64),
                                                 1: Dim("seq", min=2, max=64)},))
        gen = torch.Generator().manual_seed(0)
        inputs = {b: torch.randn(b, SEQ, HIDDEN, generator=gen) for b in range(1, 65)}
        with torch.no_grad():
            expected = {b: demo.module(x) for b, x in inputs.items()}
        rng = random.Random(9)
        seen = {"max_held": 0, "max_profile": 0, "max_queue": 0, "max_arena": 0}
        mismatches = 0
        with dynvm.Runtime(program, jit=CONFIG) as runtime:
            start = time.perf_counter()
            for call in range(1, CALLS + 1):
                batch = rng.randint(1, 64)
                out = runtime(inputs[batch])
                if call % 97 == 0:  # spot checks: results stay those of eager PyTorch
                    mismatches += not torch.allclose(out, expected[batch], atol=1e-4)
                if call % CHECK_EVERY == 0:
                    check_bounds(runtime, seen)
                if call == WARMUP:
                    warm_rss, warm_time = rss_bytes(), time.perf_counter()
                if call == (WARMUP + CALLS) // 2:
                    mid_rss = rss_bytes()
            seconds = time.perf_counter() - start
            end_rss = rss_bytes()
            stats = runtime.stats()
            queue_futures = len(runtime.jit.queue._futures)
            artifacts = len(runtime.jit.artifacts)
    finally:
        torch.set_num_threads(threads)
    growth = end_rss - warm_rss
    arena = stats["arena"]
    print(f"\nsoak: {CALLS} calls in {seconds:.1f} s "
          f"({(seconds - (warm_time - start)) / (CALLS - WARMUP) * 1e3:.2f} ms/call after "
          f"warm-up); RSS {warm_rss / 2**20:.1f} MiB after {WARMUP} calls -> "
          f"{end_rss / 2**20:.1f} MiB at the end (growth {growth / 2**20:+.2f} MiB, "
          f"limit {RSS_LIMIT_BYTES / 2**20:.0f} MiB; of it {(end_rss - mid_rss) / 2**20:+.2f} "
          f"MiB in the second half)")
    print(f"soak: compiles {stats['compiles']} (family {stats['family_compiles']}), "
          f"promotions {stats['promotions']}, evictions {stats['evictions']}, "
          f"dropped tasks {stats['dropped_tasks']}, deopts {stats['deopts']}, "
          f"specialized region calls {stats['specialized_region_calls']} / interpreted "
          f"{stats['interpreted_region_calls']}")
    print(f"soak: max per-region specializations {seen['max_held']} "
          f"(limit {CONFIG.max_specializations_per_region}), max queue {seen['max_queue']} "
          f"(limit {CONFIG.max_queue_length}), max arena bytes {seen['max_arena']} "
          f"(budget {CONFIG.arena_budget_bytes}; acquires {arena['acquires']}, refusals "
          f"{arena['refusals']}, evictions {arena['evictions']}, dropped {arena['dropped']}), "
          f"max profile table {seen['max_profile']} (limit {4 * CONFIG.window}); "
          f"compile futures kept {queue_futures}, artifacts kept {artifacts}")
    assert mismatches == 0
    assert stats["calls"] == CALLS and stats["compile_failures"] == 0
    assert stats["specialized_region_calls"] > CALLS // 2  # the JIT did serve the run
    assert stats["evictions"] > 0  # the per-region bound was reached, and held
    assert growth < RSS_LIMIT_BYTES
