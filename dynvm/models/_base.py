"""The record every demo model is handed out as.

A demo model is more than an ``nn.Module``: the VM needs example inputs and the
dynamic-shape spec to lower it with ``torch.export``, and tests/benchmarks need a
way to draw fresh inputs whose dynamic dims vary, so all of it travels together.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class DemoModel:
    """A model plus everything needed to export it and to feed it.

    ``sample_inputs(rng)`` draws each dynamic dim uniformly within the range that
    the model's builder documents (a sub-range of the declared ``Dim`` range, kept
    small so eager reference runs stay cheap) and fills the tensors with random
    values drawn from ``rng`` (through a ``torch.Generator`` seeded from it), so a
    given seed always reproduces the same inputs.
    """

    name: str
    module: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    # Whatever torch.export.export takes as ``dynamic_shapes`` for these inputs:
    # one entry per positional input, each a {axis: Dim} dict (or None if static).
    dynamic_shapes: Any
    sample_inputs: Callable[[random.Random], tuple[torch.Tensor, ...]]
    description: str = ""


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Build weights from a fixed seed without disturbing the caller's global RNG.

    Weights must be identical in every process (tests and benchmark replicas compare
    outputs), yet building a model should not reseed someone else's random stream.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def generator(rng: random.Random) -> torch.Generator:
    """A torch generator derived from ``rng``: tensor values follow the same seed."""
    return torch.Generator().manual_seed(rng.getrandbits(63))


def finish(module: nn.Module) -> nn.Module:
    """Eval mode (no dropout/batch-norm updates) and no autograd on the weights."""
    module.eval()  # safe: nn.Module.eval (inference mode), not Python's eval
    for p in module.parameters():
        p.requires_grad_(False)
    return module
