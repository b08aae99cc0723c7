"""Program-like block lists for the planner tests, shared by its example-based and
property-based tests.

Not a conftest on purpose: import what you need.
"""

from __future__ import annotations

import random

from dynvm.arena.planner import Block

# Hidden sizes of a BERT-base-like layer: head dim, model dim, MLP dim. Weighted so the
# model dim dominates, as it does in a transformer's activations.
HIDDEN = (64, 768, 768, 768, 3072)


def program_like(seed: int, ops: int | None = None) -> list[Block]:
    """The intermediates of a random straight-line program: op i writes one tensor of
    B*T*H float32 (H drawn from HIDDEN) that the next 1-4 ops read."""
    rng = random.Random(seed)
    n = ops if ops is not None else rng.randint(10, 120)
    batch, tokens = rng.choice((1, 4, 8)), rng.choice((32, 128, 512))
    blocks = []
    for i in range(n):
        uses = rng.randint(1, 4)
        blocks.append(Block(key=i, nbytes=batch * tokens * rng.choice(HIDDEN) * 4,
                            first=i, last=min(i + uses, n - 1)))
    return blocks


def overhead(size: int, bound: int) -> float:
    """How much bigger than the lower bound a plan is, as a fraction of the bound."""
    return size / bound - 1.0
