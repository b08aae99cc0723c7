"""Code families and arenas end to end, on real programs (no mocks).

Families (Note [Tiering] in dynvm.jit.region_jit, Note [Code families]): signatures of
one bucket share one kernel that reads the varying dims at run time (Note [Probes]);
its bounds never exceed the program's declared ranges; a family of one gets an exact
specialization; a hot member tiers up to an exact one; batch jitter compiles a bounded
number of kernels; a strided view never reaches a family kernel.

Arenas (Note [Arena layout], Note [Arena concurrency]): outputs never alias an arena;
concurrent calls each lease their own buffer; over budget a call runs without one;
planned forwards allocate far less than interpreted ones; eviction drops buffers.
"""

from __future__ import annotations

import random
import re
import threading
import time
import warnings

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.arena import AllocationCounter
from dynvm.jit.backends.cpu.arena_layout import ArenaBinding
from dynvm.jit.config import JitConfig
from dynvm.jit.guards import GuardStrength
from dynvm.jit.tiering import TIER_CHECK_EVERY
from dynvm.models import transformer
from tests.vm import _programs

HIDDEN, SEQ = 64, 8
SMALL = {"layers": 2, "hidden": HIDDEN, "heads": 4, "ffn": 128}
RTOL, ATOL = 1e-4, 1e-5


def family_config(**overrides) -> JitConfig:
    """K = 2 for every region, and a horizon so long that every promotion pays; no
    probation, every out= form into the arena and no oneDNN fusion (all three would come
    from timings, and a fused oneDNN call allocates its result: these tests count hits and
    allocations of the arena's own plan)."""
    fields = {"sync": True, "min_recurrence": 2, "max_recurrence": 2,
              "expected_speedup": 1.0, "horizon_calls": 10**9, "probation": False,
              "arena_ops": "all", "cpu_fusion": "off"}
    fields.update(overrides)
    return JitConfig(**fields)


@pytest.fixture(autouse=True)
def one_thread():
    with _programs.torch_threads(1):
        yield


@pytest.fixture(scope="module")
def small():
    """(demo model, program, interpreter-only runtime) of the small transformer:
    x float32 [batch 1..64, seq 2..512, 64]."""
    dm = transformer(**SMALL)
    program = dynvm.compile(dm.module, dm.example_inputs, dm.dynamic_shapes,
                            name="transformer_families")
    return dm, program, dynvm.Runtime(program, jit=False)


def x_of(batch: int, seed: int = 0, seq: int = SEQ) -> torch.Tensor:
    return torch.randn(batch, seq, HIDDEN, generator=torch.Generator().manual_seed(seed))


def eager(module, *inputs):
    with torch.inference_mode():
        return module(*inputs)


def check(actual, expected, what: str) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL,
                               msg=lambda m: f"{what}\n{m}")


def region(runtime):
    (region_jit,) = runtime.jit.regions.values()  # every model here has one region
    return region_jit


def family_kernel(runtime):
    kernels = list(region(runtime).family_kernels.values())
    assert len(kernels) == 1, [k.family.key for k in kernels]
    return kernels[0]


def strong_dims(runtime) -> dict[tuple, object]:
    """dims of the first live-in -> its exact specialization."""
    return {sig[0][0].dims: spec for sig, spec in region(runtime).strong.items()}


def warm_family(runtime, batches=(20, 30, 40)):
    for b in batches:
        runtime(x_of(b))
    spec = family_kernel(runtime)
    assert spec.strength is GuardStrength.FAMILY
    return spec


# ------------------------------------------------------------ families end to end ------


def test_family_kernel_serves_other_members_of_its_bucket(small):
    dm, program, interp = small
    rt = dynvm.Runtime(program, jit=family_config())
    spec = warm_family(rt)
    stats = rt.stats()
    assert stats["family_compiles"] >= 1, stats
    assert spec.family.bounds[0] == ((17, 64), (SEQ, SEQ), (HIDDEN, HIDDEN))
    compiles, specialized = stats["compiles"], stats["specialized_region_calls"]

    fresh = (17, 25, 33, 47, 55, 64)  # never seen before, all in bucket 17..64
    for seed, b in enumerate(fresh):
        x = x_of(b, seed)
        calls = spec.calls
        out = rt(x)
        assert spec.calls == calls + 1, f"batch {b} not served by the family kernel"
        check(out, eager(dm.module, x), f"batch {b} vs eager")
        check(out, interp(x), f"batch {b} vs interpreter")
    stats = rt.stats()
    assert stats["compiles"] == compiles, "a member of a compiled family was recompiled"
    assert stats["specialized_region_calls"] == specialized + len(fresh)
    assert stats["deopts"] == 0

    for b in (2, 16):  # other buckets: not this kernel's business
        x = x_of(b)
        calls, interpreted = spec.calls, rt.stats()["interpreted_region_calls"]
        out = rt(x)
        assert spec.calls == calls, f"batch {b} (bucket {spec.family.key}) hit the kernel"
        assert rt.stats()["interpreted_region_calls"] == interpreted + 1
        check(out, eager(dm.module, x), f"batch {b} vs eager")


@pytest.fixture(scope="module")
def mlp50():
    """An MLP whose declared batch range is 1..50: inside the bucket 17..64."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    program = dynvm.compile(module, (torch.randn(20, 16),),
                            ({0: Dim("batch", min=1, max=50)},), name="mlp50")
    return module, program


def test_family_bounds_are_clipped_to_declared_ranges(mlp50):
    module, program = mlp50
    rt = dynvm.Runtime(program, jit=family_config())
    for b in (20, 30, 40):
        rt(torch.randn(b, 16))
    spec = family_kernel(rt)
    assert spec.family.bounds[0] == ((17, 50), (16, 16)), spec.family.bounds
    assert "17..50" in spec.family.key
    assert rt.stats()["compile_failures"] == 0
    # Marked pending under the observed key (17..64), installed under the clipped one:
    # nothing may stay pending, or the family could never be promoted again.
    assert not region(rt).pending, region(rt).pending

    x = torch.randn(50, 16)
    calls = spec.calls
    check(rt(x), eager(module, x), "batch 50 (the declared maximum)")
    assert spec.calls == calls + 1, "batch 50 not served by the family kernel"
    with pytest.raises(dynvm.ShapeError, match="50"):
        rt(torch.randn(51, 16))
    assert spec.calls == calls + 1
    assert rt.stats()["deopts"] == 0


# Input register %0 is overwritten in region 0 by a rank-2 tensor that region 1 reads.
REUSED_INPUT_REGISTER = """
   0  %1 = UNSQUEEZE %0, 0
   1  %0 = RELU %1
   2  JUMP @3
   3  %2 = TANH %0
   4  %3 = SIN %2
   5  RETURN {%3}
"""


def test_declared_ranges_clip_only_registers_that_hold_inputs():
    # Regression: clip_to_declared took every live-in register below len(inputs) for
    # the input itself; here region 1's %0 is [1, n], the input [n], and the clipped
    # bounds lost a dim: Family() raised ValueError out of the call that promoted it.
    program = _programs.build(REUSED_INPUT_REGISTER, regs=4, inputs=('"x" float32 [n:1..64]',))
    rt = dynvm.Runtime(program, jit=family_config())
    for n in (20, 30, 40, 50, 25):
        x = torch.randn(n)
        check(rt(x), torch.sin(torch.tanh(torch.relu(x[None]))), f"n = {n}")
    stats = rt.stats()
    assert stats["compile_failures"] == 0 and stats["family_compiles"] == 2, stats
    bounds = {index: [s.family.bounds for s in rj.family_kernels.values()]
              for index, rj in rt.jit.regions.items()}
    assert bounds == {0: [(((17, 64),),)], 1: [(((1, 1), (17, 64)),)]}, bounds


def test_family_of_one_gets_an_exact_specialization(small):
    dm, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config())
    # 20 and 3 make the batch dim vary, but each is alone in its bucket (17..64, 2..4).
    for b in (20, 3, 20, 3):
        x = x_of(b)
        check(rt(x), eager(dm.module, x), f"batch {b}")
    stats = rt.stats()
    assert stats["family_compiles"] == 0, stats
    assert stats["compiles"] == 2, stats
    assert not region(rt).family_kernels
    exact = strong_dims(rt)
    assert set(exact) == {(20, SEQ, HIDDEN), (3, SEQ, HIDDEN)}
    assert all(s.strength is GuardStrength.STRONG and s.family is None
               for s in exact.values())
    specialized = stats["specialized_region_calls"]
    rt(x_of(20, seed=1))
    assert rt.stats()["specialized_region_calls"] == specialized + 1


# ------------------------------------------------------------------------ tier-up ------


def test_hot_member_tiers_up_to_an_exact_specialization(small):
    dm, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config(exact_over_family_gain=1.0))
    family = warm_family(rt)
    hot, other = x_of(33), x_of(25)
    for _ in range(2 * TIER_CHECK_EVERY):
        rt(hot)
    exact = strong_dims(rt).get((33, SEQ, HIDDEN))
    assert exact is not None, f"no tier-up after {2 * TIER_CHECK_EVERY} family hits"
    assert exact.strength is GuardStrength.STRONG and exact.family is None
    assert rt.stats()["compiles"] == 2 and rt.stats()["family_compiles"] == 1

    exact_calls, family_calls = exact.calls, family.calls
    check(rt(hot), eager(dm.module, hot), "tiered-up member")
    assert (exact.calls, family.calls) == (exact_calls + 1, family_calls)
    check(rt(other), eager(dm.module, other), "another member")
    assert (exact.calls, family.calls) == (exact_calls + 1, family_calls + 1)


def test_no_tier_up_when_exact_code_would_not_pay(small):
    _, program, _ = small
    # The exact kernel's benefit is the family call's mean time x this gain over the
    # horizon (10^9 calls here): at 1e-12 a compile of ~30 ms pays only if the family's
    # calls average ~30 s. At 1e-9 it promoted in 1 run of 6 at load 10 (2026-12-06
    # 05:12 UTC): ~30 ms of mean, which one call preempted for ~150 ms among the first
    # few on the family kernel reaches (the likely cause; the failure kept no timings).
    rt = dynvm.Runtime(program, jit=family_config(exact_over_family_gain=1e-12))
    family = warm_family(rt)
    hot = x_of(33)
    calls = family.calls
    for _ in range(2 * TIER_CHECK_EVERY):
        rt(hot)
    assert family.calls == calls + 2 * TIER_CHECK_EVERY
    assert not region(rt).strong
    assert rt.stats()["compiles"] == 1


# ------------------------------------------------------------------ compile storm ------


def wait_drained(runtime, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pending = sum(len(r.pending) for r in runtime.jit.regions.values())
        if runtime.stats()["queue_length"] == 0 and pending == 0:
            return
        assert time.monotonic() < deadline, f"compile queue not drained in {timeout} s"
        time.sleep(0.01)


def _storm(dm, program, batches, inputs) -> dict:
    """300 calls of jittering batch sizes on a fresh default Runtime (background
    compiles), drained; its stats, after checking a sample of batches against eager."""
    rt = dynvm.Runtime(program)  # the default, background-compiling JitConfig
    try:
        for b in batches:
            rt(inputs[b])
        wait_drained(rt)
        stats = rt.stats()
        for b in sorted(inputs)[::9]:  # and still right, whatever serves them now
            check(rt(inputs[b]), eager(dm.module, inputs[b]), f"batch {b} after the storm")
    finally:
        rt.close()
    return stats


def test_batch_jitter_compiles_at_most_a_tenth_of_the_signatures(small):
    dm, program, _ = small
    rng = random.Random(7)
    batches = [rng.randint(1, 64) for _ in range(300)]
    inputs = {b: x_of(b, seed=b) for b in set(batches)}
    distinct = len(inputs)

    def figures(stats):
        return (f"{stats['compiles']} compiles ({stats['family_compiles']} family) for "
                f"{distinct} distinct signatures in 300 calls; specialized "
                f"{stats['specialized_region_calls']}, interpreted "
                f"{stats['interpreted_region_calls']} region calls; {stats['promotions']} "
                f"promotions; probation {stats['probation']}")

    stats = _storm(dm, program, batches, inputs)
    said = figures(stats)
    if stats["compiles"] > distinct / 10:
        # Promotion prices a key by its wall-clock mean call time: on a shared 2-core
        # host one preempted call can tip one promotion (7 compiles against 6.3 in
        # loaded rehearsals, 2026-12-05/06). A storm over the bound is repeated once on
        # a fresh Runtime, and the bound must hold there; a policy that compiles more
        # fails both.
        stats = _storm(dm, program, batches, inputs)
        said = f"first storm: {said}; second: {figures(stats)}"
    assert stats["compiles"] <= distinct / 10, said
    assert stats["family_compiles"] >= 1, said
    assert stats["compile_failures"] == 0 and stats["deopts"] == 0, stats


# ------------------------------------------------------------------------- probes ------


def _code_lines(source: str) -> list[str]:
    """The generated statements, without comment lines (which quote the signature)."""
    return [line.split("#")[0] for line in source.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


VIEW_SIZES = re.compile(r"VIEW\d+\(v\d+, \[([^,\]]+),")


def test_family_source_reads_the_varying_dim_exact_source_folds_it(small):
    _, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config())
    for b in (20, 20):
        rt(x_of(b))
    exact_source = strong_dims(rt)[(20, SEQ, HIDDEN)].artifact.source
    family_source = warm_family(rt, (30, 40)).artifact.source

    family_code, exact_code = _code_lines(family_source), _code_lines(exact_source)
    family_heads = VIEW_SIZES.findall("\n".join(family_code))
    exact_heads = VIEW_SIZES.findall("\n".join(exact_code))
    assert family_heads and exact_heads, (family_source, exact_source)
    # The family kernel computes the batch from its input at run time ...
    assert any(re.search(r"= DIM\d+\(v0, 0\)", line) for line in family_code), family_source
    assert all(re.fullmatch(r"v\d+", head) for head in family_heads), family_heads
    for literal in ("17", "30", "40", "64"):
        assert literal not in family_heads, family_heads
    # ... the exact one has it folded into a literal and never asks.
    assert set(exact_heads) == {"20"}, exact_heads
    assert not any("DIM" in line for line in exact_code), exact_source


# ------------------------------------------------------------------------- arenas ------


def arena_bindings(spec) -> list[ArenaBinding]:
    """The ArenaBinding(s) a compiled kernel runs with (globals of its module)."""
    return [v for v in spec.fn.__globals__.values() if isinstance(v, ArenaBinding)]


def idle_buffer(pool, binding) -> torch.Tensor:
    """The idle buffer that the binding's last (single-threaded) call used: the pool
    hands the same owner's idle buffer of that size back."""
    before = pool.stats()["reuses"]
    buffer = pool.acquire(binding.owner, binding.layout.plan.size)
    pool.release(binding.owner, buffer)
    assert pool.stats()["reuses"] == before + 1, "the call's buffer was not kept idle"
    return buffer


def storage_range(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


@pytest.mark.parametrize("kind", ["exact", "family"])
def test_outputs_never_alias_the_arena(small, kind):
    dm, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config(exact_over_family_gain=1e-9))
    if kind == "exact":
        rt(x_of(20))
        rt(x_of(20))
        spec = strong_dims(rt)[(20, SEQ, HIDDEN)]
        batch = 20
    else:
        spec = warm_family(rt)
        batch = 50
    (binding,) = arena_bindings(spec)
    pool = rt.jit.arena_pool
    assert binding.pool is pool and "into the arena" in spec.artifact.source

    first_in, second_in = x_of(batch, seed=1), x_of(batch, seed=2)
    first_in_copy = first_in.clone()
    calls = spec.calls
    first = rt(first_in)
    kept = first.clone()
    second = rt(second_in)
    assert spec.calls == calls + 2, "not served by the specialization under test"
    torch.testing.assert_close(first, kept, rtol=0, atol=0,
                               msg="a later call overwrote an earlier call's output")
    assert not torch.equal(first, second)
    torch.testing.assert_close(first_in, first_in_copy, rtol=0, atol=0,
                               msg="the call wrote into its input")
    check(first, eager(dm.module, first_in), "first call")
    check(second, eager(dm.module, second_in), "second call")

    assert pool.stats()["arenas"] == 1  # the one buffer both calls leased
    buffer = idle_buffer(pool, binding)
    low, high = storage_range(buffer)
    assert high - low == binding.layout.plan.size
    for out in (first, second):
        start, end = storage_range(out)
        assert end <= low or start >= high, (
            f"output storage [{start:#x}, {end:#x}) lies in the arena [{low:#x}, {high:#x})")
    stats = pool.stats()
    assert stats["in_use_bytes"] == 0 and stats["refusals"] == 0, stats


def test_concurrent_calls_each_lease_their_own_arena(small):
    dm, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config(exact_over_family_gain=1e-9))
    rt(x_of(20))
    rt(x_of(20))                      # exact for batch 20 (alone in its family so far)
    family = warm_family(rt, (30, 40))  # then the family kernel for 17..64
    exact = strong_dims(rt)[(20, SEQ, HIDDEN)]
    batches = (20, 30, 40, 25, 64, 20, 47)
    cases = [(x, eager(dm.module, x)) for x in (x_of(b, seed=i) for i, b in enumerate(batches))]

    pool = rt.jit.arena_pool
    before_pool, before = pool.stats(), rt.stats()
    exact_calls, family_calls = exact.calls, family.calls
    threads_n, rounds = 8, 20
    failures: list[str] = []
    start = threading.Barrier(threads_n)

    def worker(t: int) -> None:
        start.wait()
        for i in range(rounds):
            x, want = cases[(t + i) % len(cases)]
            try:
                got = rt(x)
                torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)
            except Exception as exc:  # reported below, with the thread and call
                failures.append(f"thread {t} call {i} batch {x.shape[0]}: {exc}")

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads_n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not failures, "\n".join(failures[:5])

    after_pool, after = pool.stats(), rt.stats()
    calls = threads_n * rounds
    assert after["specialized_region_calls"] - before["specialized_region_calls"] == calls
    assert after["interpreted_region_calls"] == before["interpreted_region_calls"]
    assert (exact.calls - exact_calls) + (family.calls - family_calls) == calls
    assert exact.calls > exact_calls and family.calls > family_calls
    delta = {k: after_pool[k] - before_pool[k] for k in ("acquires", "reuses",
                                                         "allocations", "refusals")}
    assert delta["acquires"] == calls, delta           # one lease per call
    assert delta["reuses"] + delta["allocations"] == calls and delta["refusals"] == 0, delta
    assert after_pool["in_use_bytes"] == 0, after_pool  # every lease given back
    # at most one buffer per call in flight, per kernel
    assert after_pool["arenas"] <= 2 * threads_n, after_pool


def test_arena_budget_too_small_runs_without_arenas(small):
    dm, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config(arena_budget_bytes=1))
    spec = warm_family(rt)
    assert "into the arena" in spec.artifact.source  # planned, but never leased
    before, pool_before = rt.stats(), rt.jit.arena_pool.stats()
    for seed, b in enumerate((20, 33, 64)):
        x = x_of(b, seed)
        check(rt(x), eager(dm.module, x), f"batch {b} without an arena")
    after, pool = rt.stats(), rt.jit.arena_pool.stats()
    specialized = after["specialized_region_calls"] - before["specialized_region_calls"]
    assert specialized == 3
    assert pool["refusals"] - pool_before["refusals"] == specialized, pool
    assert pool["reserved_bytes"] == 0 and pool["arenas"] == 0, pool
    assert after["deopts"] == 0


def test_arena_budget_zero_turns_arenas_off(small):
    dm, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config(arena_budget_bytes=0))
    rt(x_of(20))
    rt(x_of(20))
    spec = warm_family(rt, (30, 40))
    assert rt.jit.arena_pool is None and rt.stats()["arena"] is None
    assert len(rt.jit.artifacts) == 2
    for artifact in rt.jit.artifacts.values():
        assert "into the arena" not in artifact.source
        assert "lease" not in artifact.source
    assert not arena_bindings(spec)
    for seed, b in enumerate((20, 50)):
        x = x_of(b, seed)
        check(rt(x), eager(dm.module, x), f"batch {b}")


EXACT_NOW = {"min_recurrence": 1, "instructions_per_recurrence_step": 10**6,
             "families": False}


# A region without checks or shape folding gets a weak guard (rank, element count).
WEAK_BODY = """
   0  %1 = TANH %0
   1  %2 = SUM %1, [0], False, None
   2  %3 = SIN %0
   3  %4 = SUM %3, [1], False, None
   4  %5 = CAT {%2, %4}, 0
   5  RETURN {%5}
"""


def test_weak_specialization_plans_no_arena():
    # Regression: its guard admits [1, 32] for a plan made at [4, 8], where SUM over dim
    # 0 gives 32 elements instead of 8; the out= kernel resized its block over its
    # neighbour's (SIN's), and the result was wrong by up to ~2.4.
    program = _programs.build(WEAK_BODY, regs=6, inputs=('"x" float32 [n:1..64, m:1..64]',))
    rt = dynvm.Runtime(program, jit=family_config(**EXACT_NOW))
    rt(torch.randn(4, 8))
    (spec,) = region(rt).weak.values()
    assert spec.strength is GuardStrength.WEAK
    gen = torch.Generator().manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for shape in ((4, 8), (1, 32), (2, 16), (32, 1), (4, 8)):
            x = torch.randn(*shape, generator=gen)
            want = torch.cat([torch.tanh(x).sum(0), torch.sin(x).sum(1)])
            check(rt(x), want, f"shape {shape} under the weak guard")
    assert spec.calls == 5 and rt.stats()["deopts"] == 0
    # no out= tensor was resized past what was planned for it
    assert not [w for w in caught if "resized" in str(w.message)], caught[0].message
    assert "into the arena" not in spec.artifact.source and not arena_bindings(spec)
    assert rt.jit.arena_pool.stats()["acquires"] == 0


def allocation_figures(name: str, **config) -> tuple[int, int, dict]:
    """Allocations per forward: interpreter, specialized, and the latter's by_op."""
    program, dm = _programs.compiled(name), _programs.demo(name)
    inputs = dm.sample_inputs(random.Random(0))
    plain = dynvm.Runtime(program, jit=False)
    spec = dynvm.Runtime(program, jit=family_config(**EXACT_NOW, **config))
    for _ in range(3):
        spec(*inputs)
    assert spec.stats()["compiles"] == 1, spec.stats()
    interpreted = plain.measure_allocations(*inputs)
    specialized_calls = spec.stats()["specialized_region_calls"]
    with AllocationCounter() as counter:
        spec(*inputs)
    assert spec.measure_allocations(*inputs) == counter.count
    assert spec.stats()["specialized_region_calls"] == specialized_calls + 2
    assert spec.stats()["allocations_per_forward"] == counter.count
    return interpreted, counter.count, dict(counter.by_op)


@pytest.mark.parametrize("name", ["gnn", "recommender"])
def test_planned_forward_allocates_only_its_output(name):
    interpreted, specialized, by_op = allocation_figures(name)
    figures = (f"{name}: {interpreted} allocations per forward interpreted, {specialized} "
               f"specialized ({1 - specialized / interpreted:.0%} fewer); {by_op}")
    # Every intermediate has an out= form here: what is left is the region's one output
    # (it must outlive the call, so it never lives in the arena).
    assert interpreted > 5 and specialized <= 1, figures


def test_evicted_specialization_drops_its_arena(small):
    dm, program, _ = small
    rt = dynvm.Runtime(program, jit=family_config(max_specializations_per_region=1,
                                                  families=False))
    first, second = x_of(20), x_of(40)
    rt(first)
    rt(first)
    rt(first)
    (spec20,) = region(rt).strong.values()
    (binding20,) = arena_bindings(spec20)
    pool = rt.jit.arena_pool
    stats = pool.stats()
    assert stats["arenas"] == 1 and stats["reserved_bytes"] == binding20.layout.plan.size
    assert stats["dropped"] == 0

    rt(second)
    rt(second)  # promotes 40, evicting 20
    rt(second)
    (spec40,) = region(rt).strong.values()
    assert spec40 is not spec20 and rt.stats()["evictions"] == 1
    (binding40,) = arena_bindings(spec40)
    stats = pool.stats()
    assert stats["dropped"] == 1, stats
    assert stats["arenas"] == 1, stats
    assert stats["reserved_bytes"] == binding40.layout.plan.size, stats
    assert stats["in_use_bytes"] == 0, stats
    # The evicted shape still runs, and right: interpreted, then (recurring) promoted
    # again, which evicts 40 and drops its buffer in turn.
    check(rt(first), eager(dm.module, first), "evicted shape")
    assert rt.stats()["evictions"] == 2
    stats = pool.stats()
    assert stats["dropped"] == 2 and stats["arenas"] == 0, stats
    (again,) = region(rt).strong.values()
    calls = again.calls  # the same Specialization when the compile's future is reused
    check(rt(first), eager(dm.module, first), "evicted shape, promoted again")
    assert again.calls == calls + 1
    (binding,) = arena_bindings(again)
    stats = pool.stats()
    assert stats["arenas"] == 1 and stats["reserved_bytes"] == binding.layout.plan.size


# ------------------------------------------------------ no views in family kernels ------


def strided_views(batch: int) -> dict[str, torch.Tensor]:
    base = torch.randn(SEQ, batch, HIDDEN, generator=torch.Generator().manual_seed(3))
    flat = torch.randn((batch + 1) * SEQ * HIDDEN, generator=torch.Generator().manual_seed(4))
    wide = torch.randn(batch, SEQ, 2 * HIDDEN, generator=torch.Generator().manual_seed(5))
    return {
        "transposed": base.transpose(0, 1),
        "offset": flat[SEQ * HIDDEN:].view(batch, SEQ, HIDDEN),
        "sliced": wide[:, :, ::2],
    }


@pytest.mark.parametrize("view", ["transposed", "offset", "sliced"])
def test_family_kernel_never_receives_a_view(small, view):
    dm, program, interp = small
    rt = dynvm.Runtime(program, jit=family_config(exact_over_family_gain=1e-9))
    family = warm_family(rt)
    x = strided_views(30)[view]
    assert x.shape == (30, SEQ, HIDDEN)
    assert not x.is_contiguous() or x.storage_offset() != 0
    want = eager(dm.module, x)
    calls = family.calls
    for i in range(3):  # interpreted, interpreted (promoted), then exact
        check(rt(x), want, f"{view} view, call {i}")
    check(interp(x), want, f"{view} view, interpreter")
    assert family.calls == calls, f"the family kernel ran on a {view} view"
    exact = [s for sig, s in region(rt).strong.items()
             if sig[0][2] == x.stride() and sig[0][3] == x.storage_offset()]
    assert len(exact) == 1 and exact[0].strength is GuardStrength.STRONG
    assert exact[0].calls == 1
    # A contiguous member of the same bucket still goes to the family kernel.
    check(rt(x.clone(memory_format=torch.contiguous_format)), want, "contiguous copy")
    assert family.calls == calls + 1
