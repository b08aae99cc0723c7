"""The model zoo's registry: real architectures from Hugging Face transformers,
torchvision, timm and PyTorch Geometric, in small configurations with random weights.

Each library has its own module (_hf.py, _vision.py, _pyg.py; segmentation models from
two of them in _segmentation.py) that lists its entries;
`entries()` gathers them. Nothing is downloaded: every model is built from a config
object. The model libraries are a test extra (`pip install -e ".[zoo]"`), never a
runtime dependency of dynvm; `dynvm bench zoo` imports this registry from a checkout.

Note [Zoo shape points]
~~~~~~~~~~~~~~~~~~~~~~~
A shape point names every dynamic dim of an entry ({"batch": 3, "seq": 17}); the
entry's `make_inputs(point, seed)` builds inputs of exactly that shape. `export_point`
is the shape the model is exported on; `held_out` are at least three other points,
never the exported one, on which the interpreter and the JIT are compared with eager.
Where torch.export specialized a dim the model's forward fixes (a ViT's image size, a
Whisper encoder's 30-second window), the entry keeps that dim static and says so in
`note`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.export import Dim

Point = dict[str, int]


@dataclass(frozen=True)
class Built:
    """A zoo model, built: the module in eval mode and how to feed it."""

    module: torch.nn.Module
    """The model in eval mode, taking positional tensors and returning a tensor or a
    tuple of tensors (HF models are wrapped to drop their keyword-only interface)."""

    dynamic_shapes: tuple
    """What torch.export takes, one entry per positional input."""

    make_inputs: Callable[[Point, int], tuple[torch.Tensor, ...]]
    """Inputs at a shape point (Note [Zoo shape points]), drawn from a seeded generator."""


@dataclass(frozen=True)
class ZooEntry:
    name: str
    """Short architecture name, unique in the zoo (the test id and the docs' row)."""

    library: str
    """The library the architecture comes from: transformers, torchvision, timm or
    torch_geometric."""

    build: Callable[[], Built]
    """Builds the model from a config (seeded: the same weights every time)."""

    export_point: Point
    held_out: tuple[Point, ...]
    """At least three points other than `export_point` (Note [Zoo shape points])."""

    note: str = ""
    """What the entry had to give up to export (a specialized dim, self-loops added by
    the input generator instead of the model, ...), stated for the docs."""

    rtol: float = 1e-4
    atol: float = 1e-4
    """Tolerance against eager, fp32 (Note [Zoo tolerance] in _zoo_harness)."""

    dims: tuple[str, ...] = field(init=False)
    """The dynamic dims' names, from export_point."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "dims", tuple(self.export_point))
        if len(self.held_out) < 3:
            raise ValueError(f"zoo entry {self.name}: needs >= 3 held-out shapes")
        if any(p == self.export_point for p in self.held_out):
            raise ValueError(f"zoo entry {self.name}: the export shape is not held out")
        if any(set(p) != set(self.export_point) for p in self.held_out):
            raise ValueError(f"zoo entry {self.name}: every point names the same dims")


def dim(name: str, lo: int, hi: int) -> Dim:
    return Dim(name, min=lo, max=hi)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@functools.cache
def entries() -> tuple[ZooEntry, ...]:
    """Every zoo entry, by library (imports the model libraries)."""
    from tests.zoo._schemas import declare_torchvision_schemas

    declare_torchvision_schemas()  # before transformers or timm import torchvision
    from tests.zoo import _hf, _pyg, _segmentation, _vision

    found = (*_hf.ENTRIES, *_vision.ENTRIES, *_segmentation.ENTRIES, *_pyg.ENTRIES)
    names = [e.name for e in found]
    if len(set(names)) != len(names):
        raise ValueError(f"zoo entry names repeat: {names}")
    return found


def by_name(name: str) -> ZooEntry:
    for entry in entries():
        if entry.name == name:
            return entry
    raise KeyError(f"no zoo entry {name!r}; known: {', '.join(e.name for e in entries())}")
