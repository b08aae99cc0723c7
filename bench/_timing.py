"""Shared helpers of the benchmark scripts: percentiles and shape walks."""

from __future__ import annotations

import random
import statistics


def order_cycle(count: int) -> int:
    """How many calls `call_order` takes to come back to its first order."""
    return count if count % 2 == 0 else 2 * count


def call_order(names: list, call: int) -> list:
    """The order in which `names` run on call number `call`: the rows of a Williams
    design (a Latin square balanced for the one before), in turn. Over a cycle of
    `order_cycle(len(names))` calls every system runs in every position equally often
    and right after each other system equally often. Why the predecessor matters: the
    one before warms the caches on the same input (an interpreter measured 0.95x against
    itself when it always followed the other interpreter). Rotations alone left every
    system after the same one; rotations and their reverse balance neighbours only for
    three systems: with four (eager, interpreter A, interpreter B, JIT) B never ran right
    after eager, and the A/A came out 0.93-0.94 on 256 calls."""
    count = len(names)
    cycle = order_cycle(count)
    row = call % cycle
    # First row 0, 1, n-1, 2, n-2, ...; row r adds r (mod n); for odd n the mirrored
    # rows follow, which balances the pairs a single odd square cannot.
    first, low, high = [0], 1, count - 1
    while len(first) < count:
        first.append(low)
        low += 1
        if len(first) < count:
            first.append(high)
            high -= 1
    indices = [(i + row) % count for i in first]
    if row >= count:
        indices.reverse()
    return [names[i] for i in indices]


def cycle_order(names: list, round_: int, index: int) -> list:
    """The order of `names` for input `index` of a repeated cycle of inputs, in round
    `round_`: `call_order` at round + index. Numbering the calls straight through a cycle
    of k inputs gives input i only the orders i, i+k, i+2k, ... of the cycle: with 4
    inputs and 4 systems, one of the four, so a system stayed in the same place on the
    same input and a shape-dependent effect of position became a bias of that system. By
    round + index every input runs in every order once per cycle of rounds."""
    return call_order(names, round_ + index)


def balanced_rounds(inputs: int, systems: int, calls: int) -> int:
    """Rounds of `inputs` inputs giving at least `calls` calls, rounded up to whole
    cycles of the orders (`cycle_order`), so that every input ran in every order
    equally often."""
    cycle = order_cycle(systems)
    rounds = -(-calls // max(1, inputs))
    return -(-rounds // cycle) * cycle


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
