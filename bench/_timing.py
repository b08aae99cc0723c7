"""Shared helpers of the benchmark scripts: percentiles and shape walks."""

from __future__ import annotations

import functools
import itertools
import random
import statistics


def order_cycle(count: int) -> int:
    """How many calls one cycle of `call_order` takes: over it every system runs in
    every position, and right after each system, equally often."""
    return len(_row_circuit(count))


def call_order(names: list, call: int) -> list:
    """The order in which `names` run on call number `call` (Note [Call order]). Over a
    cycle of `order_cycle(len(names))` consecutive calls every system runs in every
    position equally often, and right after each system (itself included, across calls)
    equally often; from cycle to cycle the systems trade places in the design, so that
    no system keeps a fixed distance from another. Why it matters: the system before
    warms or spoils the caches (an interpreter measured 0.95x against itself when it
    always followed the other interpreter)."""
    rows = _williams_rows(len(names))
    circuit = _row_circuit(len(names))
    cycle, at = divmod(call, len(circuit))
    labels = _relabeling(len(names), cycle)
    return [names[labels[i]] for i in rows[circuit[at]]]


# Note [Call order]
# ~~~~~~~~~~~~~~~~~
# Within one call the systems run in the order of a row of a Williams design: a Latin
# square whose rows put every system right after each other system equally often (first
# row 0, 1, n-1, 2, n-2, ...; row r adds r mod n; for odd n the mirrored rows join, as a
# single odd square cannot balance the pairs). Rotations alone left every system after
# the same one; rotations and their reverse balance neighbours only for three systems:
# with four (eager, interpreter A, interpreter B, JIT) B never ran right after eager,
# and the A/A read 0.93-0.94.
#
# The calls run back to back, so the last system of one call is the predecessor of the
# first of the next. Taking the rows in turn (row r, r+1, ...) made that boundary pair a
# fixed diagonal: with four systems, the one listed last began the next call right after
# eager twice per cycle where the others did once or never. So the rows are taken along
# an Eulerian circuit of the graph "row a may be followed by row b": complete, self-loops
# included, for even n; for odd n, between the plain and the mirrored rows. Each edge is
# one boundary pair (last of a, first of b), and the circuit takes every edge once, so
# every ordered pair of systems (a system after itself included) meets at a boundary
# equally often, and every row is used equally often. A cycle: n*n calls for even n,
# 2*n*n for odd.
#
# That balances the one before, not the one two or three before: in the Williams square
# of four, index 2 never runs two places after index 0. Eager is the system that spoils
# the caches most (its own weights and allocations), so with eager listed first the
# system listed third ran farther from eager's last call than the others. So each cycle
# maps the design's indices to the systems by another permutation (all of them in turn,
# in an order shuffled once): every system takes every index's part equally often over
# n! cycles, and no distance between two systems is fixed. Measured on the loop workload
# (calls of 0.1-0.2 ms, thread CPU time, 900 steady calls, three identical interpreter
# Runtimes A, B, C besides eager): rows in turn, the one listed last read 1.02-1.05x A;
# along the circuit, 1.004-1.010 (and the one listed second 0.98-1.00); with the
# relabeling, B and C read 0.995 and 0.996 of A. The "creation-order effect" that an
# earlier report blamed on per-Runtime objects was this: with the Runtimes created in the
# same order but listed in another, the slow one moved with the listing.


def _relabeling(count: int, cycle: int) -> tuple[int, ...]:
    """The system each index of the design stands for in cycle `cycle` (Note [Call
    order]): every permutation in turn, in an order shuffled once."""
    if count > 7:   # 8! permutations is more than any run has cycles
        labels = list(range(count))
        random.Random(cycle).shuffle(labels)
        return tuple(labels)
    every = _permutations(count)
    return every[cycle % len(every)]


@functools.cache
def _permutations(count: int) -> tuple[tuple[int, ...], ...]:
    every = list(itertools.permutations(range(count)))
    random.Random(count).shuffle(every)
    return tuple(every)


@functools.cache
def _williams_rows(count: int) -> tuple[tuple[int, ...], ...]:
    first, low, high = [0], 1, count - 1
    while len(first) < count:
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    rows = [tuple((i + r) % count for i in first) for r in range(count)]
    if count % 2:
        rows += [row[::-1] for row in rows]
    return tuple(rows)


@functools.cache
def _row_circuit(count: int) -> tuple[int, ...]:
    """Row indices along an Eulerian circuit of the row-succession graph (Note [Call
    order]), by Hierholzer's walk; deterministic."""
    rows = len(_williams_rows(count))
    half = rows // 2
    if count % 2:   # odd: plain rows lead to mirrored rows and back
        edges = {a: [b for b in range(rows) if (a < half) != (b < half)] for a in range(rows)}
    else:
        edges = {a: list(range(rows)) for a in range(rows)}
    unused = {a: list(reversed(targets)) for a, targets in edges.items()}
    stack, circuit = [0], []
    while stack:
        node = stack[-1]
        if unused[node]:
            stack.append(unused[node].pop())
        else:
            circuit.append(stack.pop())
    circuit.reverse()
    return tuple(circuit[:-1])   # the walk returns to row 0; the cycle repeats from it


def stream_input(step: int, inputs: int, systems: int) -> int:
    """Which of `inputs` repeated inputs runs at `step` of a stream whose steps take
    `call_order(names, step)` (`systems` names): the next input each step, and one
    more after each cycle of the orders. Steps run back to back, so the orders must
    follow each other unbroken (Note [Call order]); and numbered straight through, a
    cycle of k inputs would give input i only the orders i, i+k, i+2k, ... (with 4
    inputs under 4 systems, one order in four), so that a shape-dependent effect of
    position became a bias of a system. With the shift, over `inputs` cycles of the
    orders every input takes every place of the cycle once (each cycle under its own
    relabeling of the systems, Note [Call order])."""
    cycle = order_cycle(systems)
    return (step % cycle + step // cycle) % inputs


def balanced_steps(inputs: int, systems: int, calls: int) -> int:
    """Steps of `stream_input` giving at least `calls` calls per system, rounded up to
    whole periods, so that every input took every place of the cycle equally often."""
    period = inputs * order_cycle(systems)
    return -(-max(1, calls) // period) * period


def aa_margin(ratios: list[float], parts: int = 3) -> float:
    """The stated margin of "JIT <= interpreter" (Note [A/A margin]): the largest
    distance from 1 of the A/A's median per call, over all `ratios` (a second
    interpreter's time over the first's, call by call) and over each of `parts`
    consecutive stretches of them."""
    if not ratios:
        raise ValueError("no A/A ratios")
    size = max(1, len(ratios) // parts)
    stretches = [ratios] + [ratios[i:i + size] for i in range(0, size * parts, size)
                            if ratios[i:i + size]]
    return max(abs(statistics.median(stretch) - 1.0) for stretch in stretches)


# Note [A/A margin]
# ~~~~~~~~~~~~~~~~~
# "JIT p50 <= interpreter p50" needs a margin: two identical interpreter Runtimes in one
# rotation (the A/A) do not read 1.000. The margin was once the A/A's own distance from
# 1 over the run: one sample of the noise, against which a JIT with no effect at all
# fails about one run in four (the JIT's distance is another sample of the same noise).
# gnn, where the JIT ends detached and runs the interpreter's own plan, read 0.999,
# 1.004, 1.005 and 1.003, 1.004, 1.004 against A/As of 1.002, 1.002, 1.003 and 1.003,
# 1.003, 1.000 in six runs; with three identical interpreters and the JIT in one rotation
# their thirds spread 0.996-1.006. So the margin is what the A/A itself shows over the
# same run: its largest distance from 1 over the whole run and over each third of it.
# That is the resolution of this run; a JIT over it is slower than this run can
# attribute to noise, and is reported as a miss.


def percentile(samples: list[float], p: float) -> float:
    """Nearest-rank percentile (always a latency that was measured)."""
    ordered = sorted(samples)
    rank = max(1, min(len(ordered), round(p / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def random_walk(values: list[int], steps: int, seed: int, stay: float = 0.5) -> list[int]:
    """A walk over `values` that stays with probability `stay`, else moves to a
    neighbour (reflecting at the ends): the design article's batch-size pattern."""
    rng = random.Random(seed)
    position = rng.randrange(len(values))
    walk = []
    for _ in range(steps):
        walk.append(values[position])
        if rng.random() >= stay:
            step = rng.choice((-1, 1))
            if not 0 <= position + step < len(values):
                step = -step
            position += step
    return walk


BATCHES = [1, 4, 16, 64]
SEQ = 32


def walk_setup(description: str, calls: int, warmup: int):
    """Parse the walk benchmarks' common options, set threads and seed, and lower the
    demo Transformer once: (args, demo model, program)."""
    import argparse

    import torch

    import dynvm
    from dynvm.models import transformer

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--calls", type=int, default=calls)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    demo = transformer()
    program = dynvm.compile(demo.module, demo.example_inputs, demo.dynamic_shapes,
                            name="transformer")
    return args, demo, program
