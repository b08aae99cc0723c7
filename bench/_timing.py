"""Shared helpers of the benchmark scripts: percentiles and shape walks."""

from __future__ import annotations

import random
import statistics


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
