"""A small DLRM-style recommender: dense MLP + pooled embedding bags + top MLP.

The bag pooling is written as ``nn.Embedding`` + ``sum`` rather than
``nn.EmbeddingBag`` on purpose: it is what many user models do, it exports to plain
``embedding`` + ``sum`` ops, and it keeps the batch dim as the only dynamic one.
"""

from __future__ import annotations

import random
from itertools import pairwise

import torch
from torch import nn
from torch.export import Dim

from ._base import DemoModel, finish, generator, seeded

DENSE_FEATURES = 13  # as in the Criteo/DLRM setup
EMBED_DIM = 32
# (rows, bag size) per sparse feature: different sizes so no two inputs look alike.
SPARSE_FEATURES = ((1000, 3), (800, 5), (1200, 1), (500, 4))
# forward() below names one input per entry; keep the two in step.


def _mlp(*sizes: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class Recommender(nn.Module):
    """DLRM-style: a dense bottom MLP, one pooled embedding bag per sparse
    feature, their concatenation through a top MLP to one score per row."""

    def __init__(self) -> None:
        super().__init__()
        self.bottom = nn.Sequential(_mlp(DENSE_FEATURES, 64, EMBED_DIM), nn.ReLU())
        self.tables = nn.ModuleList(nn.Embedding(rows, EMBED_DIM) for rows, _ in SPARSE_FEATURES)
        interact = EMBED_DIM * (1 + len(SPARSE_FEATURES))
        self.top = _mlp(interact, 128, 64, 1)

    # Named positional inputs, not ``*sparse``: torch.export would want a nested
    # dynamic_shapes entry for a varargs tuple, and the VM takes a flat input list.
    def forward(
        self,
        dense: torch.Tensor,
        sparse0: torch.Tensor,
        sparse1: torch.Tensor,
        sparse2: torch.Tensor,
        sparse3: torch.Tensor,
    ) -> torch.Tensor:
        sparse = (sparse0, sparse1, sparse2, sparse3)
        # Each sparse input is [batch, bag]; embed to [batch, bag, dim], then pool the
        # bag away by summing, which is what EmbeddingBag(mode="sum") computes.
        pooled = [table(idx).sum(dim=1) for table, idx in zip(self.tables, sparse, strict=True)]
        z = torch.cat([self.bottom(dense), *pooled], dim=1)
        return torch.sigmoid(self.top(z))


def recommender(max_batch: int = 1024) -> DemoModel:
    """Inputs: dense float32 [batch, 13], then one int64 [batch, bag_i] per sparse
    feature (bags 3, 5, 1, 4). Output: sigmoid score [batch, 1].

    Dims: batch in [1, max_batch]; ``sample_inputs`` draws batch in
    [1, min(max_batch, 256)].
    """
    with seeded(0):
        module = finish(Recommender())
    batch = Dim("batch", min=1, max=max_batch)

    def make(b: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
        dense = torch.randn(b, DENSE_FEATURES, generator=gen)
        sparse = tuple(
            torch.randint(0, rows, (b, bag), generator=gen) for rows, bag in SPARSE_FEATURES
        )
        return (dense, *sparse)

    def sample_inputs(rng: random.Random) -> tuple[torch.Tensor, ...]:
        return make(rng.randint(1, min(max_batch, 256)), generator(rng))

    # Every input shares the one batch Dim; bag sizes are static per feature.
    dynamic_shapes = tuple({0: batch} for _ in range(1 + len(SPARSE_FEATURES)))
    return DemoModel(
        name="recommender",
        module=module,
        example_inputs=make(8, torch.Generator().manual_seed(1)),
        dynamic_shapes=dynamic_shapes,
        sample_inputs=sample_inputs,
        description=(
            f"DLRM-like: bottom MLP on {DENSE_FEATURES} dense features, "
            f"{len(SPARSE_FEATURES)} sum-pooled embedding bags (dim {EMBED_DIM}), "
            "top MLP -> sigmoid; dynamic batch"
        ),
    )
