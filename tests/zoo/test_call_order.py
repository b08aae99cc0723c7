"""The benchmarks' call order (bench._timing, Note [Call order]): every system in every
position equally often, every system right after each other one equally often, across
the calls' boundaries too, and no fixed distance between two systems."""

from __future__ import annotations

from collections import Counter
from itertools import permutations

import pytest

from bench._timing import _williams_rows, balanced_steps, call_order, order_cycle, stream_input

COUNTS = [2, 3, 4, 5, 6, 7]


def _cycle(names: list, cycle: int = 0) -> list[list]:
    size = order_cycle(len(names))
    return [call_order(names, cycle * size + at) for at in range(size)]


def test_three_systems_run_in_every_order_equally_often():
    names = ["eager", "interp", "jit"]
    seen = Counter(tuple(order) for order in _cycle(names))
    assert set(seen) == set(permutations(names)) and len(set(seen.values())) == 1


@pytest.mark.parametrize("count", COUNTS)
def test_positions_and_predecessors_are_balanced_within_a_cycle(count):
    names = [f"s{i}" for i in range(count)]
    for cycle in (0, 5):
        orders = _cycle(names, cycle)
        assert all(sorted(order) == names for order in orders)
        positions = Counter((i, name) for order in orders for i, name in enumerate(order))
        assert len(positions) == count * count and len(set(positions.values())) == 1
        # Within a call, who runs right before whom: every ordered pair of distinct
        # systems equally often. With rotations and their reverse, four systems left two
        # pairs never adjacent (the second interpreter never ran right after eager).
        inside = Counter(pair for order in orders for pair in zip(order[:-1], order[1:]))
        assert len(inside) == count * (count - 1) and len(set(inside.values())) == 1
        # Across calls: the last of one call, then the first of the next (the cycle
        # closed on itself). With the rows taken in turn this was a fixed diagonal: the
        # system listed last began the next call right after eager twice per cycle.
        across = Counter((a[-1], b[0]) for a, b in zip(orders, orders[1:] + orders[:1]))
        assert len(across) == count * count and len(set(across.values())) == 1


def test_rows_in_turn_would_have_left_the_boundary_unbalanced():
    # The bias the circuit removes, on the design's own rows taken in turn (r, r+1, ...):
    # the boundary pairs are one diagonal, 4 of the 16.
    rows = _williams_rows(4)
    in_turn = Counter((a[-1], b[0]) for a, b in zip(rows, rows[1:] + rows[:1]))
    assert len(in_turn) == 4


@pytest.mark.parametrize("count", [3, 4, 5])
def test_no_system_keeps_a_fixed_distance_from_another(count):
    # Two places apart within a call: over every relabeling, each ordered pair equally
    # often. One Williams square of four never puts index 2 two places after index 0.
    names = [f"s{i}" for i in range(count)]
    first = _cycle(names)
    fixed = Counter((o[i], o[i + 2]) for o in first for i in range(count - 2))
    cycles = len(list(permutations(range(count))))
    two_apart = Counter((o[i], o[i + 2]) for cycle in range(cycles)
                        for o in _cycle(names, cycle) for i in range(count - 2))
    assert len(two_apart) == count * (count - 1) and len(set(two_apart.values())) == 1
    if count == 4:
        assert len(fixed) < count * (count - 1)


@pytest.mark.parametrize("inputs,systems", [(4, 4), (4, 5), (3, 4), (1, 3), (6, 4)])
def test_every_input_meets_every_place_in_the_cycle(inputs, systems):
    names = [f"s{i}" for i in range(systems)]
    size = order_cycle(systems)
    steps = balanced_steps(inputs, systems, calls=50)
    assert steps >= 50 and steps % (inputs * size) == 0
    places = Counter((stream_input(step, inputs, systems), step % size)
                     for step in range(steps))
    assert len(places) == inputs * size and len(set(places.values())) == 1
    # and the inputs still come round one after another within a cycle
    assert [stream_input(step, inputs, systems) for step in range(min(size, 8))] \
        == [step % inputs for step in range(min(size, 8))]
    assert all(sorted(call_order(names, step)) == names for step in range(steps))
