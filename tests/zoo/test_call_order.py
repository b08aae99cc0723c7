"""The benchmarks' call order (bench._timing.call_order): every system in every position
equally often, and every system right after each other one equally often, over a cycle."""

from __future__ import annotations

import math
from collections import Counter
from itertools import permutations

import pytest

from bench._timing import balanced_rounds, call_order, cycle_order, order_cycle


def test_three_systems_cycle_through_all_six_orders():
    orders = [tuple(call_order(["eager", "interp", "jit"], call)) for call in range(6)]
    assert sorted(orders) == sorted(permutations(["eager", "interp", "jit"]))
    assert call_order(["eager", "interp", "jit"], 6) == list(orders[0])


@pytest.mark.parametrize("count", [2, 3, 4, 5, 6, 7])
def test_positions_and_predecessors_are_balanced(count):
    names = [f"s{i}" for i in range(count)]
    cycle = [call_order(names, call) for call in range(order_cycle(count))]
    assert call_order(names, len(cycle)) == cycle[0]
    assert all(sorted(order) == names for order in cycle)
    positions = Counter((i, name) for order in cycle for i, name in enumerate(order))
    assert len(positions) == count * count and len(set(positions.values())) == 1
    # Within a call, who runs right before whom: every ordered pair of distinct systems
    # equally often. With rotations and their reverse, four systems left two pairs
    # never adjacent (the second interpreter never ran right after eager).
    pairs = Counter(pair for order in cycle for pair in zip(order[:-1], order[1:]))
    assert len(pairs) == count * (count - 1) and len(set(pairs.values())) == 1


@pytest.mark.parametrize("inputs,systems", [(4, 4), (4, 5), (3, 4), (1, 3), (6, 4)])
def test_every_input_runs_in_every_order_over_balanced_rounds(inputs, systems):
    names = [f"s{i}" for i in range(systems)]
    cycle = order_cycle(systems)
    rounds = balanced_rounds(inputs, systems, calls=50)
    assert rounds * inputs >= 50 and rounds % cycle == 0
    every_order = {tuple(call_order(names, call)) for call in range(cycle)}
    for index in range(inputs):
        seen = Counter(tuple(cycle_order(names, r, index)) for r in range(rounds))
        assert set(seen) == every_order, index
        assert len(set(seen.values())) == 1, index   # each order equally often
    # Numbered straight through the cycle, input 0 sees every order only when the
    # input count is coprime to the cycle (4 inputs under 4 systems: 1 of 4 orders),
    # the bias cycle_order removes.
    straight = {tuple(call_order(names, r * inputs)) for r in range(rounds)}
    assert (straight == every_order) == (math.gcd(inputs, cycle) == 1)
