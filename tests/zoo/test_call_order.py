"""The benchmarks' call order (bench._timing.call_order): every system in every position
equally often, and every system right after each other one equally often, over a cycle."""

from __future__ import annotations

from collections import Counter
from itertools import permutations

import pytest

from bench._timing import call_order


def test_three_systems_cycle_through_all_six_orders():
    orders = [tuple(call_order(["eager", "interp", "jit"], call)) for call in range(6)]
    assert sorted(orders) == sorted(permutations(["eager", "interp", "jit"]))
    assert call_order(["eager", "interp", "jit"], 6) == list(orders[0])


@pytest.mark.parametrize("count", [2, 3, 4, 5, 7])
def test_positions_and_predecessors_are_balanced(count):
    names = [f"s{i}" for i in range(count)]
    cycle = [call_order(names, call) for call in range(2 * count)]
    assert all(sorted(order) == names for order in cycle)
    positions = Counter((i, name) for order in cycle for i, name in enumerate(order))
    assert set(positions.values()) == {2}
    # Within a call, who runs right before whom: each ordered pair of cyclic neighbours
    # as often as its reverse (rotations alone gave one direction only).
    pairs = Counter(pair for order in cycle for pair in zip(order[:-1], order[1:]))
    assert pairs
    for (a, b), seen in pairs.items():
        assert pairs[(b, a)] == seen, (a, b)
