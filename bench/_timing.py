"""Shared helpers of the benchmark scripts: percentiles and shape walks."""

from __future__ import annotations

import random
import statistics


def call_order(names: list, call: int) -> list:
    """The order in which `names` run on call number `call`: the rotations of the list,
    then the rotations of its reverse. Rotating alone left every system always right
    after the same one (the one before it warms the caches for it on the same input: an
    interpreter measured 0.95x against itself that way); with the reversed rotations
    each system follows each of its neighbours equally often, and for three systems the
    cycle is all six orders."""
    count = len(names)
    step = call % (2 * count)
    base = list(names) if step < count else list(reversed(names))
    shift = step % count
    return base[shift:] + base[:shift]


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
