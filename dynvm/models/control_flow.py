"""Models whose *structure* depends on the input data, not just their shapes.

``branchy`` picks one of two sub-networks with ``torch.cond``; ``looping`` runs a
residual block a data-dependent number of times with ``torch.while_loop``. Both
keep the choice inside the graph as a higher-order op (plain Python ``if``/``for``
on tensor values would either fail to export or be baked in for the example input),
so the VM has to execute real branches and loops.
"""

from __future__ import annotations

import random

import torch
from torch import nn
from torch.export import Dim

from ._base import DemoModel, finish, generator, seeded

FEATURES = 32
MAX_TRIPS = 8
TRIP_SCALE = 4.0

# torch.while_loop is public from torch 2.6-ish; older builds only have the private one.
_while_loop = getattr(torch, "while_loop", None)
if _while_loop is None:  # pragma: no cover - depends on the torch build
    from torch._higher_order_ops.while_loop import while_loop as _while_loop


class Branchy(nn.Module):
    """Picks a deep or a shallow sub-network with torch.cond on the input's mean."""

    def __init__(self) -> None:
        super().__init__()
        # The two branches differ in depth and ops so that taking the wrong one is
        # visible in the output; both map [batch, F] -> [batch, F] float32, which
        # torch.cond requires.
        self.deep = nn.Sequential(
            nn.Linear(FEATURES, 64), nn.ReLU(), nn.Linear(64, FEATURES), nn.ReLU()
        )
        self.shallow = nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def positive(x: torch.Tensor) -> torch.Tensor:
            return self.deep(x)

        def negative(x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.shallow(x)) + x

        # The predicate is a 0-dim bool tensor computed from the data: export cannot
        # know it, so both branches are traced and the choice happens at run time.
        return torch.cond(x.mean() > 0, positive, negative, (x,))


class Looping(nn.Module):
    """Runs a residual block a data-dependent number of times (torch.while_loop),
    the trip count derived from the input's magnitude."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(FEATURES, FEATURES)
        self.head = nn.Linear(FEATURES, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Trip count in [1, MAX_TRIPS], kept as an int64 0-dim tensor (no .item()):
        # larger-magnitude inputs get more refinement steps.
        trips = torch.clamp(torch.round(x.abs().mean() * TRIP_SCALE), 1, MAX_TRIPS).long()
        step = torch.zeros((), dtype=torch.int64, device=x.device)

        def cond_fn(i: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
            return i < trips  # `trips` is captured; export lifts it to a loop input

        def body_fn(i: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # Same shapes and dtypes out as in, as while_loop requires of carried values.
            return i + 1, h + torch.tanh(self.block(h)) * 0.5

        _, h = _while_loop(cond_fn, body_fn, (step, x))
        return self.head(h)


def _batch_model(
    name: str, module: nn.Module, description: str, scale: bool, max_batch: int
) -> DemoModel:
    batch = Dim("batch", min=1, max=max_batch)

    def sample_inputs(rng: random.Random) -> tuple[torch.Tensor, ...]:
        b = rng.randint(1, min(max_batch, 256))
        x = torch.randn(b, FEATURES, generator=generator(rng))
        # With unit-variance inputs the trip count would nearly always be 3; scaling
        # by a random factor spreads it over the whole [1, MAX_TRIPS] range.
        return (x * rng.uniform(0.25, 2.5),) if scale else (x,)

    return DemoModel(
        name=name,
        module=module,
        example_inputs=(torch.randn(8, FEATURES, generator=torch.Generator().manual_seed(1)),),
        dynamic_shapes=({0: batch},),
        sample_inputs=sample_inputs,
        description=description,
    )


def branchy(max_batch: int = 1024) -> DemoModel:
    """x float32 [batch, 32] -> [batch, 32]: ``torch.cond(x.mean() > 0, ...)`` picks a
    two-layer ReLU MLP or a tanh residual layer.

    Dims: batch in [1, max_batch]; ``sample_inputs`` draws batch in
    [1, min(max_batch, 256)] with standard-normal values, so either branch is likely.
    """
    with seeded(0):
        module = finish(Branchy())
    return _batch_model(
        "branchy",
        module,
        "torch.cond on x.mean() > 0 between a 2-layer MLP and a tanh residual layer; dynamic batch",
        scale=False,
        max_batch=max_batch,
    )


def looping(max_batch: int = 1024) -> DemoModel:
    """x float32 [batch, 32] -> [batch, 32]: ``torch.while_loop`` applies
    ``h + tanh(linear(h)) * 0.5`` clamp(round(mean|x| * 4), 1, 8) times, then a
    linear head.

    Dims: batch in [1, max_batch]; ``sample_inputs`` draws batch in
    [1, min(max_batch, 256)] and, unlike the uniform default, scales the
    standard-normal values by a factor uniform in [0.25, 2.5] so the trip count
    varies between draws.
    """
    with seeded(0):
        module = finish(Looping())
    return _batch_model(
        "looping",
        module,
        f"torch.while_loop running a tanh residual block 1..{MAX_TRIPS} times "
        "(trip count from mean |x|); dynamic batch",
        scale=True,
        max_batch=max_batch,
    )
