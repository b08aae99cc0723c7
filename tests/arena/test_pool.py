"""Arena buffers at run time: reuse, one buffer per in-flight call, budget, eviction,
refusal, drop, and the counters."""

from __future__ import annotations

import threading
import time
import weakref

import pytest
import torch

from dynvm.arena.pool import ArenaPool

CPU = torch.device("cpu")
KB = 1024


def test_acquire_returns_an_exact_uint8_buffer_on_the_device():
    pool = ArenaPool(CPU, budget_bytes=64 * KB)
    buffer = pool.acquire("spec", 1000)
    assert buffer is not None
    assert buffer.dtype == torch.uint8 and buffer.device == CPU
    assert buffer.shape == (1000,) and buffer.is_contiguous()
    assert buffer.data_ptr() % 64 == 0  # the planner's offsets assume an aligned base
    pool.release("spec", buffer)


def test_idle_buffer_is_reused_by_the_same_owner():
    pool = ArenaPool(CPU, budget_bytes=64 * KB)
    first = pool.acquire("spec", 4 * KB)
    pool.release("spec", first)
    again = pool.acquire("spec", 4 * KB)
    assert again is first
    pool.release("spec", again)
    stats = pool.stats()
    assert stats["allocations"] == 1 and stats["reuses"] == 1 and stats["arenas"] == 1


def test_idle_buffer_is_not_reused_by_another_owner_or_size():
    pool = ArenaPool(CPU, budget_bytes=64 * KB)
    first = pool.acquire("a", 4 * KB)
    pool.release("a", first)
    assert pool.acquire("b", 4 * KB) is not first
    assert pool.acquire("a", 8 * KB) is not first
    assert pool.stats()["arenas"] == 3


def test_overlapping_calls_of_one_owner_get_different_buffers():
    pool = ArenaPool(CPU, budget_bytes=64 * KB)
    one, two = pool.acquire("spec", 4 * KB), pool.acquire("spec", 4 * KB)
    assert one is not None and two is not None
    assert one.data_ptr() != two.data_ptr()
    pool.release("spec", one)
    three = pool.acquire("spec", 4 * KB)
    assert three is one  # the idle one, never the one still held
    pool.release("spec", two)
    pool.release("spec", three)
    assert pool.stats()["arenas"] == 2


def test_threads_never_share_a_buffer():
    pool = ArenaPool(CPU, budget_bytes=8 * 4 * KB)  # room for every thread's buffer
    errors: list[str] = []
    start = threading.Barrier(8)

    def work(tid: int) -> None:
        start.wait()
        for round_ in range(60):
            buffer = pool.acquire("spec", 4 * KB)
            if buffer is None:
                errors.append(f"thread {tid} refused in round {round_}")
                return
            buffer.fill_(tid)
            time.sleep(0.0002)  # let the others run while this call holds its buffer
            if not bool((buffer == tid).all()):
                errors.append(f"thread {tid}'s buffer was overwritten in round {round_}")
            pool.release("spec", buffer)

    threads = [threading.Thread(target=work, args=(tid,)) for tid in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    stats = pool.stats()
    assert stats["acquires"] == 8 * 60 and stats["in_use_bytes"] == 0
    assert stats["allocations"] <= 8 and stats["reuses"] == 8 * 60 - stats["allocations"]


def test_budget_is_never_exceeded():
    pool = ArenaPool(CPU, budget_bytes=10 * KB)
    held = [pool.acquire("spec", 3 * KB) for _ in range(3)]
    assert all(b is not None for b in held)
    assert pool.acquire("spec", 3 * KB) is None  # 12 KB > 10 KB, nothing idle to free
    assert pool.acquire("spec", 1 * KB) is not None  # exactly 10 KB fits
    assert pool.stats()["reserved_bytes"] == 10 * KB


def test_request_larger_than_the_budget_is_refused():
    pool = ArenaPool(CPU, budget_bytes=4 * KB)
    assert pool.acquire("spec", 4 * KB + 1) is None
    assert pool.stats()["refusals"] == 1 and pool.stats()["reserved_bytes"] == 0


def test_idle_buffers_of_other_owners_are_freed_least_recently_used_first():
    pool = ArenaPool(CPU, budget_bytes=12 * KB)
    a, b, c = (pool.acquire(o, 4 * KB) for o in "abc")
    pool.release("b", b)  # release order makes b the least recently used, then c, then a
    pool.release("c", c)
    pool.release("a", a)
    d = pool.acquire("d", 4 * KB)
    assert d is not None
    stats = pool.stats()
    assert stats["evictions"] == 1 and stats["reserved_bytes"] == 12 * KB
    # b was freed: a and c are still reused, b needs a new buffer (and evicts c, now LRU).
    assert pool.acquire("a", 4 * KB) is a
    assert pool.acquire("b", 4 * KB) is not b
    assert pool.stats()["evictions"] == 2
    assert pool.acquire("c", 4 * KB) is None  # a, b, d all in use


def test_eviction_frees_just_enough():
    pool = ArenaPool(CPU, budget_bytes=12 * KB)
    for owner in "abc":
        pool.release(owner, pool.acquire(owner, 4 * KB))
    assert pool.acquire("d", 8 * KB) is not None
    stats = pool.stats()
    assert stats["evictions"] == 2 and stats["arenas"] == 2 and stats["idle_bytes"] == 4 * KB


def test_refusal_frees_nothing_when_even_freeing_every_idle_buffer_would_not_do():
    pool = ArenaPool(CPU, budget_bytes=12 * KB)
    held = pool.acquire("a", 8 * KB)
    pool.release("b", pool.acquire("b", 4 * KB))
    assert pool.acquire("c", 8 * KB) is None
    stats = pool.stats()
    assert stats["evictions"] == 0 and stats["idle_bytes"] == 4 * KB and stats["refusals"] == 1
    pool.release("a", held)


def test_drop_frees_idle_buffers_and_in_use_ones_on_release():
    pool = ArenaPool(CPU, budget_bytes=64 * KB)
    idle = pool.acquire("spec", 4 * KB)
    busy = pool.acquire("spec", 4 * KB)
    pool.release("spec", idle)
    other = pool.acquire("other", 4 * KB)
    pool.drop("spec")
    assert pool.stats()["reserved_bytes"] == 8 * KB  # busy and other remain
    pool.release("spec", busy)
    stats = pool.stats()
    assert stats["reserved_bytes"] == 4 * KB and stats["arenas"] == 1 and stats["dropped"] == 2
    # A new specialization under the same name starts afresh.
    fresh = pool.acquire("spec", 4 * KB)
    assert fresh is not idle and fresh is not busy
    pool.release("spec", fresh)
    assert pool.acquire("spec", 4 * KB) is fresh
    pool.release("other", other)


def test_dropped_memory_is_really_freed():
    pool = ArenaPool(CPU, budget_bytes=64 * KB)
    buffer = pool.acquire("spec", 4 * KB)
    alive = weakref.ref(buffer)
    pool.release("spec", buffer)
    del buffer
    assert alive() is not None  # the pool keeps it for the next call
    pool.drop("spec")
    assert alive() is None


def test_release_of_an_unknown_buffer_raises():
    pool = ArenaPool(CPU, budget_bytes=64 * KB)
    with pytest.raises(ValueError, match="is not in use from this pool"):
        pool.release("spec", torch.empty(16, dtype=torch.uint8))
    buffer = pool.acquire("spec", 4 * KB)
    with pytest.raises(ValueError, match="a view of the acquired tensor"):
        pool.release("spec", buffer[:16])
    with pytest.raises(ValueError, match="acquired by 'spec', not 'other'"):
        pool.release("other", buffer)
    pool.release("spec", buffer)
    with pytest.raises(ValueError, match="already released"):
        pool.release("spec", buffer)


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True])
def test_acquire_rejects_a_bad_size(nbytes):
    pool = ArenaPool(CPU, budget_bytes=64 * KB)
    with pytest.raises(ValueError, match="nbytes must be an int > 0"):
        pool.acquire("spec", nbytes)


def test_bad_budget_raises():
    with pytest.raises(ValueError, match="budget_bytes must be an int >= 0, got -1"):
        ArenaPool(CPU, budget_bytes=-1)


def test_allocation_failure_is_a_refusal():
    pool = ArenaPool(CPU, budget_bytes=1 << 62)
    assert pool.acquire("spec", 1 << 61) is None  # no machine has 2 EiB
    stats = pool.stats()
    assert stats["refusals"] == 1 and stats["reserved_bytes"] == 0 and stats["arenas"] == 0


def test_stats_counts():
    pool = ArenaPool(CPU, budget_bytes=8 * KB)
    a = pool.acquire("a", 4 * KB)          # allocation
    pool.release("a", a)
    a = pool.acquire("a", 4 * KB)          # reuse
    b = pool.acquire("b", 4 * KB)          # allocation
    assert pool.acquire("c", 4 * KB) is None  # refusal: both in use
    pool.release("b", b)
    c = pool.acquire("c", 4 * KB)          # allocation, evicts b
    assert pool.stats() == {
        "reserved_bytes": 8 * KB, "in_use_bytes": 8 * KB, "idle_bytes": 0,
        "budget_bytes": 8 * KB, "arenas": 2, "acquires": 5, "reuses": 1, "allocations": 3,
        "evictions": 1, "refusals": 1, "dropped": 0}
    pool.release("a", a)
    pool.release("c", c)
    assert pool.stats()["in_use_bytes"] == 0 and pool.stats()["idle_bytes"] == 8 * KB
    assert "reserved=8192" in repr(pool)


def test_acquire_and_release_cost_a_few_microseconds():
    from dynvm.arena.pool import _measure_cost
    # Measured 1.3-2 us per pair on the project's CPU machine; the bound is loose so
    # that a busy test machine does not fail it, but catches an accidental slow path.
    assert _measure_cost(rounds=20_000) < 25.0
