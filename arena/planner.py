"""Offset planning: place a specialization's intermediate tensors in one byte arena.

A specialization's intermediates are described as `Block`s: a size and the span of
positions [first, last] (inclusive) during which the tensor must keep its bytes. Two
blocks whose spans intersect must not share bytes; blocks whose spans are disjoint may.
`plan_arena` assigns every block a byte offset so that this holds and returns the
arena size needed. Finding the smallest such arena is NP-hard (it is a form of dynamic
storage allocation / 2-D strip packing), so the planner runs a few cheap greedy
heuristics and keeps the smallest result.

Note [Greedy offset planning]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every heuristic is one placement loop run over the blocks in some order. A block is
placed against the blocks already placed *that conflict with it* (intersecting spans);
the others are invisible to it. Sorted by offset, those conflicting blocks leave gaps
of free bytes between them (and an unbounded gap above the highest one). The block goes
into the smallest gap that holds it (best fit: big gaps stay free for the big blocks
still to come, ties go to the lowest offset); if no gap is large enough, it goes on
top of the highest conflicting block. Two orders seed the search:

- by size: largest block first, ties broken by birth position. Big blocks fix the
  arena's shape early and small ones fill the holes they leave; this is the order of
  TFLite's "greedy by size" planner (Pisarchyk & Lee, "Efficient Memory Management for
  Deep Neural Net Inference", 2020). Breaking ties by birth (rather than by longer span)
  lays equal-sized activations of a straight-line program out in program order, which
  measured fewer holes on program-like lists.
- by breadth: blocks live at the position with the most live bytes (the peak that
  sets the lower bound) first, largest first within it, then the next busiest position's
  remaining blocks, and so on. This packs the peak tightly before anything else can
  fragment it.

Then each order is refined a few times: the blocks that touch the top of the arena
are the ones that were placed badly (or came too late to find a hole), so they move to
the front of the order and the loop runs again. The smallest plan seen wins; the
search stops early once a plan meets the lower bound, which no plan can beat.
`lower_bound` is that bound: at any position the blocks live there need pairwise
disjoint bytes, so no arena is smaller than the largest total of aligned sizes live at
one position (it is not always reachable: holes between spans can force more).

Measured on 1000 program-like lists (tests/arena/_arena_blocks.py): the two seed
orders alone were 0.7% over the bound on average, 2.7% of lists more than 10% over;
with refinement 0.06% on average, 97% exactly at the bound and 1 list in 1000 more
than 10% over (by 10.1%).

Cost: conflicts are found once by a sweep over blocks sorted by birth, O(n log n + c)
for c conflicting pairs (c <= n^2, about 2.5n for a straight-line program). A placement
pass is O(sum over blocks of k log k) for k placed conflicts of each block, and there
are 2 * (1 + _REFINE_ROUNDS) passes at most. Measured on a 2-core CPU: a program-like
list of 600 blocks plans in under 10 ms; 1000 blocks each overlapping about half of the
others (c ~ n^2 / 3) take 2 to 3 s, nearly all of it in the refinement passes. Planning
runs once per specialization, in the background compile, never on the request path.

Sizes are rounded up to `alignment` before planning, so every offset is a multiple of
it and `size` includes the padding of the topmost block. The arena's base address must
itself be aligned (torch's CPU allocator aligns to 64 bytes, CUDA's to 512).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from dynvm.vm.errors import DynvmError


class ArenaPlanError(DynvmError, ValueError):
    """A block list or an alignment the planner cannot accept."""


@dataclass(frozen=True, slots=True)
class Block:
    """One intermediate tensor: its bytes must stay untouched from `first` to `last`."""

    key: int
    """The caller's id for this tensor (e.g. a register number); unique in one plan."""
    nbytes: int
    """Size in bytes, > 0."""
    first: int
    """Position of the operation that writes it."""
    last: int
    """Position of its last use, inclusive; first <= last."""


@dataclass(frozen=True, slots=True)
class ArenaPlan:
    """Where each block lives in the arena."""

    offsets: Mapping[int, int]
    """Block key -> byte offset from the arena's base, a multiple of the alignment."""
    size: int
    """Bytes the arena needs: the highest offset + aligned size over all blocks."""
    lower_bound: int
    """The most aligned bytes live at any one position; no valid plan is smaller."""


def plan_arena(blocks: Sequence[Block], alignment: int = 64) -> ArenaPlan:
    """Offsets for `blocks` such that blocks live at the same time never share bytes.

    Runs the search of Note [Greedy offset planning] and returns the smallest plan it
    finds; the result depends only on the set of blocks, not on their order. Raises
    ArenaPlanError (a ValueError) naming the block for a duplicate key, a size <= 0 or
    first > last, and for an alignment that is not a positive power of two.
    """
    _check(blocks, alignment)
    bound = _peak(blocks, alignment)
    if not blocks:
        return ArenaPlan(offsets=MappingProxyType({}), size=0, lower_bound=0)
    problem = _Problem.of(blocks, alignment)
    best_offsets: list[int] = []
    best_size = -1
    for order in (_by_size(problem), _by_breadth(problem)):
        for _ in range(1 + _REFINE_ROUNDS):
            offsets = _place(problem, order)
            size = max(off + sz for off, sz in zip(offsets, problem.sizes))
            if best_size < 0 or size < best_size:
                best_offsets, best_size = offsets, size
            if best_size == bound:
                break
            order = _top_first(problem, order, offsets, size)
        if best_size == bound:
            break
    return ArenaPlan(
        offsets=MappingProxyType({b.key: off for b, off in zip(blocks, best_offsets)}),
        size=best_size, lower_bound=bound)


def lower_bound(blocks: Sequence[Block], alignment: int = 64) -> int:
    """The most aligned bytes live at one position: no arena for `blocks` is smaller."""
    _check(blocks, alignment)
    return _peak(blocks, alignment)


def _check(blocks: Sequence[Block], alignment: int) -> None:
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise ArenaPlanError(f"alignment must be a positive power of two, got {alignment!r}")
    seen: set[int] = set()
    for index, block in enumerate(blocks):
        if block.key in seen:
            raise ArenaPlanError(f"duplicate key {block.key!r}: blocks[{index}] = {block}")
        seen.add(block.key)
        if block.nbytes <= 0:
            raise ArenaPlanError(
                f"block key {block.key!r} has nbytes {block.nbytes}, expected > 0: {block}")
        if block.first > block.last:
            raise ArenaPlanError(
                f"block key {block.key!r} ends before it starts "
                f"(first {block.first} > last {block.last}): {block}")


def _aligned(nbytes: int, alignment: int) -> int:
    return (nbytes + alignment - 1) & ~(alignment - 1)


def _peak(blocks: Sequence[Block], alignment: int) -> int:
    # Sweep over span boundaries: a block adds its bytes at `first` and removes them at
    # `last + 1`. Removals sort before additions at the same position (-size < +size),
    # so a block dying at p and one born at p+1 are never counted together.
    events = []
    for b in blocks:
        size = _aligned(b.nbytes, alignment)
        events.append((b.first, size))
        events.append((b.last + 1, -size))
    events.sort()
    live = peak = 0
    for _, delta in events:
        live += delta
        peak = max(peak, live)
    return peak


# How many times each seed order is refined (Note [Greedy offset planning]). Measured on
# the tests' program-like lists: 4 rounds got most of the gain, 16 little more than 8.
_REFINE_ROUNDS = 8


@dataclass(frozen=True, slots=True)
class _Problem:
    """The blocks as parallel tuples indexed 0..n-1, with their conflicts precomputed,
    so that each placement pass touches only what it needs."""

    keys: tuple[int, ...]
    sizes: tuple[int, ...]          # aligned sizes
    firsts: tuple[int, ...]
    lasts: tuple[int, ...]
    conflicts: tuple[tuple[int, ...], ...]  # i -> indices whose spans intersect i's

    @staticmethod
    def of(blocks: Sequence[Block], alignment: int) -> _Problem:
        n = len(blocks)
        firsts = tuple(b.first for b in blocks)
        lasts = tuple(b.last for b in blocks)
        conflicts: list[list[int]] = [[] for _ in range(n)]
        # Sorted by birth, block j (after i) conflicts with i exactly when it is born
        # before i dies, so the inner loop stops at the first j born after i's death.
        by_birth = sorted(range(n), key=lambda i: firsts[i])
        for pos, i in enumerate(by_birth):
            for later in range(pos + 1, n):
                j = by_birth[later]
                if firsts[j] > lasts[i]:
                    break
                conflicts[i].append(j)
                conflicts[j].append(i)
        return _Problem(keys=tuple(b.key for b in blocks),
                        sizes=tuple(_aligned(b.nbytes, alignment) for b in blocks),
                        firsts=firsts, lasts=lasts,
                        conflicts=tuple(tuple(c) for c in conflicts))


def _by_size(problem: _Problem) -> list[int]:
    # The key breaks the last ties, so the plan never depends on the input order.
    return sorted(range(len(problem.sizes)),
                  key=lambda i: (-problem.sizes[i], problem.firsts[i], problem.keys[i]))


def _by_breadth(problem: _Problem) -> list[int]:
    n = len(problem.sizes)
    # The live total changes only where a span starts or ends, and every span contains
    # its own endpoints, so the endpoints are enough to find each block's busiest position.
    positions = sorted(set(problem.firsts) | set(problem.lasts))
    index = {p: k for k, p in enumerate(positions)}
    delta = [0] * (len(positions) + 1)
    for i in range(n):
        delta[index[problem.firsts[i]]] += problem.sizes[i]
        delta[index[problem.lasts[i]] + 1] -= problem.sizes[i]
    breadth = list(itertools.accumulate(delta[:-1]))
    busiest = [max(breadth[index[problem.firsts[i]]:index[problem.lasts[i]] + 1])
               for i in range(n)]
    return sorted(range(n), key=lambda i: (-busiest[i], -problem.sizes[i], problem.firsts[i],
                                           problem.keys[i]))


def _top_first(problem: _Problem, order: list[int], offsets: list[int], size: int) -> list[int]:
    top = [i for i in order if offsets[i] + problem.sizes[i] == size]
    rest = [i for i in order if offsets[i] + problem.sizes[i] != size]
    return top + rest


def _place(problem: _Problem, order: list[int]) -> list[int]:
    """One greedy pass: each block in `order` into the smallest gap that holds it among
    the already placed blocks it conflicts with, else on top of them."""
    offsets = [-1] * len(problem.sizes)  # -1: not placed yet
    for i in order:
        size = problem.sizes[i]
        taken = sorted((offsets[j], offsets[j] + problem.sizes[j])
                       for j in problem.conflicts[i] if offsets[j] >= 0)
        best_gap = best_offset = -1
        cursor = 0
        for start, end in taken:
            gap = start - cursor
            if gap >= size and (best_gap < 0 or gap < best_gap):
                best_gap, best_offset = gap, cursor
            cursor = max(cursor, end)
        offsets[i] = best_offset if best_gap >= 0 else cursor
    return offsets
