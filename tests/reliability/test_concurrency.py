"""Many threads calling one Runtime at once (JIT, families and arenas on), with random
shapes, while the background thread compiles, installs and evicts underneath them.

Every result must equal eager PyTorch's for the same input; no arena buffer may be
leased to two live calls at once; no output may live in an arena buffer; every lease
must be given back. tests/jit/test_families_arenas.py checks concurrent calls of
kernels installed beforehand; this test runs the whole JIT life cycle concurrently.

The lease check wraps the runtime's `ArenaPool` (`runtime.jit.arena_pool`, the one
object every specialization leases from) at its public `acquire`/`release`, before any
kernel exists: each granted buffer's byte range must not overlap a range still held.
The interpreter's thread switch interval is cut to 10 us for the test, so that threads
interleave inside short critical sections instead of once every 5 ms.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import weakref

import pytest
import torch
from torch.export import Dim

import dynvm
from dynvm.jit.background import serving
from dynvm.models import transformer

pytestmark = pytest.mark.slow

THREADS = 8
CALLS_PER_THREAD = 300
HIDDEN = 16
CONFIG = dynvm.JitConfig(
    min_recurrence=2, max_recurrence=2, horizon_calls=100_000,  # promote readily
    families=True, bucket_ratio=2,
    max_specializations_per_region=4,   # evictions while calls run
    arena_budget_bytes=1 << 20,         # buffers evicted and refused under load
    compile_threads=1,
    # The arena's and the cache's mechanics under threads, not timings: every out= form
    # into the arena, no oneDNN rewrite, no probation (each would come from measurements
    # and could leave nothing to lease or evict).
    arena_ops="all", cpu_fusion="off", probation=False,
)


class LeaseChecker:
    """Wraps one ArenaPool's acquire/release; records any overlap of live leases."""

    def __init__(self, pool) -> None:
        self._acquire, self._release = pool.acquire, pool.release
        self._lock = threading.Lock()
        self.live: dict[int, tuple[int, int, str]] = {}  # id(buffer) -> (start, end, owner)
        self.handed_out: list[weakref.ref] = []
        self.overlaps: list[str] = []
        self.leases = 0
        self.max_live = 0
        pool.acquire, pool.release = self.acquire, self.release

    def acquire(self, owner: str, nbytes: int):
        buffer = self._acquire(owner, nbytes)
        if buffer is None:
            return None
        start = buffer.untyped_storage().data_ptr()
        end = start + buffer.untyped_storage().nbytes()
        with self._lock:
            for other_start, other_end, other_owner in self.live.values():
                if start < other_end and other_start < end:
                    self.overlaps.append(f"{owner} got [{start:#x}, {end:#x}) while "
                                         f"{other_owner} holds [{other_start:#x}, "
                                         f"{other_end:#x})")
            self.live[id(buffer)] = (start, end, owner)
            self.handed_out.append(weakref.ref(buffer))
            self.leases += 1
            self.max_live = max(self.max_live, len(self.live))
        return buffer

    def release(self, owner: str, buffer) -> None:
        with self._lock:  # forgotten before the pool may hand it out again
            self.live.pop(id(buffer), None)
        self._release(owner, buffer)

    def arena_ranges(self) -> list[tuple[int, int]]:
        """Byte ranges of every arena buffer still alive (held or idle in the pool)."""
        with self._lock:
            buffers = [ref() for ref in self.handed_out]
        return [(b.untyped_storage().data_ptr(),
                 b.untyped_storage().data_ptr() + b.untyped_storage().nbytes())
                for b in buffers if b is not None]


def test_threads_calling_one_runtime_get_eager_results_and_private_arenas():
    demo = transformer(layers=1, hidden=HIDDEN, heads=2, ffn=32, max_batch=64, max_seq=64)
    program = dynvm.compile(demo.module, (torch.randn(4, 32, HIDDEN),),
                            dynamic_shapes=({0: Dim("batch", min=1, max=64),
                                             1: Dim("seq", min=2, max=64)},))
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(5)
    # Few enough shapes that they recur (and get promoted), many enough to evict.
    shapes = [(rng.randint(1, 64), rng.choice((8, 16, 32))) for _ in range(16)]
    cases = []
    for batch, seq in shapes:
        x = torch.randn(batch, seq, HIDDEN, generator=gen)
        with torch.no_grad():
            cases.append((x, demo.module(x)))  # serial eager reference

    runtime = dynvm.Runtime(program, jit=CONFIG)
    checker = LeaseChecker(runtime.jit.arena_pool)
    failures: list[str] = []
    start = threading.Barrier(THREADS)

    def worker(t: int) -> None:
        order = random.Random(t)
        start.wait()
        for i in range(CALLS_PER_THREAD):
            x, want = cases[order.randrange(len(cases))]
            try:
                got = runtime(x)
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
                out = got.untyped_storage()
                low, high = out.data_ptr(), out.data_ptr() + out.nbytes()
                for a_low, a_high in checker.arena_ranges():
                    assert high <= a_low or low >= a_high, "output lies in an arena"
            except Exception as exc:  # reported below with the thread and call
                failures.append(f"thread {t} call {i} shape {tuple(x.shape)}: "
                                f"{type(exc).__name__}: {exc}")

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    # The compile worker does not pace itself against the calls here (Note [Background
    # work yields to calls]): eight threads leave it no gap, and this test needs its
    # compiles, installs and evictions inside the calls' few seconds, not its manners
    # (tests/jit/test_pacing.py has those).
    activity = serving()
    activity.pacing = False
    try:
        workers = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
        activity.pacing = True
        runtime.close()
    stats = runtime.stats()
    pool = stats["arena"]
    print(f"\nconcurrency: {THREADS} threads x {CALLS_PER_THREAD} calls, "
          f"{len(cases)} shapes: compiles {stats['compiles']}, evictions {stats['evictions']}, "
          f"specialized {stats['specialized_region_calls']} / interpreted "
          f"{stats['interpreted_region_calls']}, deopts {stats['deopts']}; leases "
          f"{checker.leases} (at most {checker.max_live} live at once), refusals "
          f"{pool['refusals']}, overlaps {len(checker.overlaps)}")
    assert not any(w.is_alive() for w in workers)
    assert not failures, "\n".join(failures[:5])
    assert not checker.overlaps, "\n".join(checker.overlaps[:5])
    assert stats["calls"] == THREADS * CALLS_PER_THREAD
    assert checker.leases > 0 and checker.max_live >= 2  # arenas really ran concurrently
    assert stats["evictions"] > 0  # kernels were evicted while calls were running
    assert stats["deopts"] == 0, runtime.jit.event_log[-5:]
    # Every lease returned: close() lets the compile worker finish the task it is
    # running, and since background work runs kernels (a prewarm before an install,
    # Note [Prewarmed installs]) that task may hold a lease for a moment.
    deadline = time.monotonic() + 30
    while (runtime.stats()["arena"]["in_use_bytes"] or checker.live) \
            and time.monotonic() < deadline:
        time.sleep(0.01)
    pool = runtime.stats()["arena"]
    assert pool["in_use_bytes"] == 0 and not checker.live, pool
