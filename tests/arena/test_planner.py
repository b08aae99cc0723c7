"""Offset planning: validity on random block lists, optimality on hand-built ones, and
quality against the lower bound on program-like ones."""

from __future__ import annotations

import itertools
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dynvm.arena.planner import ArenaPlan, ArenaPlanError, Block, lower_bound, plan_arena
from tests.arena._arena_blocks import overhead, program_like

KB = 1024


def aligned(nbytes: int, alignment: int) -> int:
    return -(-nbytes // alignment) * alignment


def assert_valid(blocks: list[Block], plan: ArenaPlan, alignment: int = 64) -> None:
    """Every pair of blocks live at the same time has disjoint byte ranges; offsets are
    aligned; the arena holds every block and is no smaller than the bound."""
    assert set(plan.offsets) == {b.key for b in blocks}
    for b in blocks:
        assert plan.offsets[b.key] % alignment == 0, b
        assert plan.offsets[b.key] >= 0
        assert plan.offsets[b.key] + aligned(b.nbytes, alignment) <= plan.size, b
    for a, b in itertools.combinations(blocks, 2):
        if a.first <= b.last and b.first <= a.last:
            a_lo, b_lo = plan.offsets[a.key], plan.offsets[b.key]
            a_hi, b_hi = a_lo + aligned(a.nbytes, alignment), b_lo + aligned(b.nbytes, alignment)
            assert a_hi <= b_lo or b_hi <= a_lo, (a, b, plan.offsets)
    assert plan.lower_bound == lower_bound(blocks, alignment)
    assert plan.size >= plan.lower_bound


# -- hand-built cases with a known optimum ------------------------------------------------

def test_empty():
    plan = plan_arena([])
    assert plan.size == 0 and plan.lower_bound == 0 and dict(plan.offsets) == {}


def test_single_block_is_rounded_up_to_the_alignment():
    plan = plan_arena([Block(key=7, nbytes=100, first=0, last=0)])
    assert dict(plan.offsets) == {7: 0}
    assert plan.size == 128 == plan.lower_bound


def test_chain_where_each_block_dies_as_the_next_is_born_needs_only_the_largest():
    # Block i is written at i and last read at i (by the op that writes i + 1's input,
    # here modelled as disjoint spans), so nothing is ever live together.
    sizes = [4 * KB, 16 * KB, 8 * KB, 16 * KB, 2 * KB]
    blocks = [Block(key=i, nbytes=n, first=i, last=i) for i, n in enumerate(sizes)]
    plan = plan_arena(blocks)
    assert_valid(blocks, plan)
    assert plan.size == max(sizes) == plan.lower_bound
    assert set(plan.offsets.values()) == {0}


def test_chain_of_producer_consumer_pairs_needs_the_largest_adjacent_pair():
    # Block i is written at i and read at i + 1: neighbours overlap, others do not.
    sizes = [4 * KB, 16 * KB, 8 * KB, 16 * KB, 2 * KB]
    blocks = [Block(key=i, nbytes=n, first=i, last=i + 1) for i, n in enumerate(sizes)]
    plan = plan_arena(blocks)
    assert_valid(blocks, plan)
    assert plan.size == max(a + b for a, b in itertools.pairwise(sizes)) == plan.lower_bound


def test_two_overlapping_blocks_need_their_sum():
    blocks = [Block(key=1, nbytes=3 * KB, first=0, last=2),
              Block(key=2, nbytes=5 * KB, first=2, last=4)]
    plan = plan_arena(blocks)
    assert_valid(blocks, plan)
    assert plan.size == 8 * KB == plan.lower_bound


def test_diamond():
    # Op 0: x = f(in); op 1: a = g(x); op 2: b = h(x); op 3: y = a + b; op 4 reads y.
    # x is read by both branches, a and b are both read by the join.
    blocks = [Block(key=0, nbytes=8 * KB, first=0, last=2),   # x, read by a and b
              Block(key=1, nbytes=4 * KB, first=1, last=3),   # a
              Block(key=2, nbytes=4 * KB, first=2, last=3),   # b
              Block(key=3, nbytes=8 * KB, first=3, last=4)]   # y = a + b
    plan = plan_arena(blocks)
    assert_valid(blocks, plan)
    # At position 2: x + a + b = 16 KB; at 3: a + b + y = 16 KB. y reuses x's bytes.
    assert plan.size == 16 * KB == plan.lower_bound
    assert plan.offsets[3] == plan.offsets[0]


def test_block_dying_at_a_position_conflicts_with_one_born_there():
    # Spans are inclusive: a block read by op 3 still holds its bytes while op 3 writes.
    blocks = [Block(key=0, nbytes=KB, first=0, last=3), Block(key=1, nbytes=KB, first=3, last=5)]
    assert plan_arena(blocks).size == 2 * KB
    blocks = [Block(key=0, nbytes=KB, first=0, last=2), Block(key=1, nbytes=KB, first=3, last=5)]
    assert plan_arena(blocks).size == KB


def test_small_blocks_fill_the_hole_a_large_one_leaves():
    # A long-lived 1 KB block beside a short 8 KB one; after the 8 KB block dies, two
    # 4 KB blocks fit in its hole instead of on top.
    blocks = [Block(key=0, nbytes=KB, first=0, last=9),
              Block(key=1, nbytes=8 * KB, first=0, last=2),
              Block(key=2, nbytes=4 * KB, first=3, last=9),
              Block(key=3, nbytes=4 * KB, first=4, last=9)]
    plan = plan_arena(blocks)
    assert_valid(blocks, plan)
    assert plan.size == 9 * KB == plan.lower_bound


def test_plan_does_not_depend_on_input_order():
    blocks = program_like(seed=3)
    forward, backward = plan_arena(blocks), plan_arena(blocks[::-1])
    assert forward == backward


def test_offsets_are_read_only():
    plan = plan_arena([Block(key=0, nbytes=1, first=0, last=0)])
    with pytest.raises(TypeError):
        plan.offsets[0] = 64  # type: ignore[index]


def test_other_alignments():
    blocks = [Block(key=i, nbytes=100 + i, first=i, last=i + 2) for i in range(10)]
    for alignment in (1, 8, 256):
        plan = plan_arena(blocks, alignment=alignment)
        assert_valid(blocks, plan, alignment)


# -- validation ---------------------------------------------------------------------------

@pytest.mark.parametrize(("blocks", "alignment", "message"), [
    ([Block(1, 64, 0, 1), Block(1, 64, 2, 3)], 64, "duplicate key 1"),
    ([Block(5, 0, 0, 1)], 64, "block key 5 has nbytes 0"),
    ([Block(6, -8, 0, 1)], 64, "block key 6 has nbytes -8"),
    ([Block(7, 64, 3, 2)], 64, r"block key 7 ends before it starts \(first 3 > last 2\)"),
    ([], 48, "alignment must be a positive power of two, got 48"),
    ([], 0, "alignment must be a positive power of two, got 0"),
    ([], -64, "alignment must be a positive power of two, got -64"),
])
def test_invalid_input_raises_a_value_error_naming_it(blocks, alignment, message):
    with pytest.raises(ArenaPlanError, match=message) as info:
        plan_arena(blocks, alignment)
    assert isinstance(info.value, ValueError)
    with pytest.raises(ArenaPlanError, match=message):
        lower_bound(blocks, alignment)


# -- random block lists: every plan is valid ----------------------------------------------

@st.composite
def block_lists(draw) -> list[Block]:
    n = draw(st.integers(min_value=0, max_value=60))
    blocks = []
    for key in range(n):
        first = draw(st.integers(min_value=0, max_value=40))
        length = draw(st.integers(min_value=0, max_value=15))
        nbytes = draw(st.one_of(st.integers(min_value=1, max_value=5000),
                                st.sampled_from([64, 128, 4096, 65536])))
        blocks.append(Block(key=key * 3 + 1, nbytes=nbytes, first=first, last=first + length))
    return blocks


@settings(max_examples=150, deadline=None)
@given(block_lists(), st.sampled_from([1, 16, 64, 512]))
def test_random_block_lists_get_valid_plans(blocks, alignment):
    assert_valid(blocks, plan_arena(blocks, alignment), alignment)


@settings(max_examples=50, deadline=None)
@given(st.integers(min_value=0, max_value=10**6))
def test_program_like_lists_get_valid_plans(seed):
    blocks = program_like(seed)
    assert_valid(blocks, plan_arena(blocks))


# -- quality on program-like lists --------------------------------------------------------

def test_quality_on_a_fixed_set_of_program_like_lists():
    # Measured (tests/arena/_arena_blocks.py, seeds 0..49, when this test was written):
    # mean overhead over the lower bound 0.15%, max 7.7%; 49 of 50 plans exactly at the
    # bound. Over seeds 0..999: mean 0.06%, max 10.1%, 971 at the bound, 999 within 10%.
    # The assertions leave a little room over the measured numbers, so that a change in
    # tie-breaking fails only when it really makes plans worse.
    overheads = []
    for seed in range(50):
        blocks = program_like(seed)
        plan = plan_arena(blocks)
        assert_valid(blocks, plan)
        overheads.append(overhead(plan.size, plan.lower_bound))
    assert statistics.mean(overheads) <= 0.005, overheads
    assert max(overheads) <= 0.08, overheads
    assert sum(o == 0 for o in overheads) >= 48, overheads


def test_quality_on_a_large_majority_of_program_like_lists():
    within = sum(overhead(plan.size, plan.lower_bound) <= 0.10
                 for plan in (plan_arena(program_like(seed)) for seed in range(1000, 1300)))
    assert within >= 0.97 * 300, within
