"""`Program`: the unit dynvm loads, saves, verifies and runs.

A program is code (a tuple of instructions), a register count, its constants (weights),
and its I/O signature: each input's name, dtype and dims (static or a named range), and
the pytree structure of the inputs and outputs. Inputs occupy registers 0..n_inputs-1;
the RETURN instruction lists the output registers. Constants are read through `Const`
operands and never copied into registers.

A program never depends on a concrete shape (see DESIGN.md, Invariants). It is immutable;
its regions and content hash are derived once, on first use.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from dynvm.vm.instr import Instr
from dynvm.vm.regions import Region, compute_regions


@dataclass(frozen=True, slots=True)
class DimSpec:
    """One dim of an input: static (`low == high`, no name) or dynamic in [low, high]."""

    name: str
    low: int
    high: int

    @property
    def is_static(self) -> bool:
        return self.low == self.high and not self.name

    def __str__(self) -> str:
        return str(self.low) if self.is_static else f"{self.name}:{self.low}..{self.high}"


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One positional input of a program: its name, dtype and per-dim declared
    range (`DimSpec`: static, or dynamic between `low` and `high`)."""

    name: str
    dtype: torch.dtype
    dims: tuple[DimSpec, ...]

    @property
    def dynamic_dims(self) -> tuple[int, ...]:
        return tuple(i for i, d in enumerate(self.dims) if not d.is_static)

    def as_assert_operand(self) -> tuple:
        """The dims literal SHAPE_ASSERT carries: (low, high, name) per dim."""
        return tuple((d.low, d.high, d.name) for d in self.dims)


@dataclass(frozen=True, slots=True)
class ConstSpec:
    """A constant's name, dtype and shape, as listings and the file's header show it."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class Program:
    """A lowered model: register bytecode, the inputs' declared signature, the
    constants (weights) and the pytree specs that give inputs and outputs the module's
    structure. Immutable; `regions` and `content_hash` are computed once, on first use."""

    code: tuple[Instr, ...]
    n_regs: int
    inputs: tuple[InputSpec, ...]
    constants: tuple[torch.Tensor, ...]
    constant_names: tuple[str, ...]
    in_spec: str
    """torch.utils._pytree treespec (JSON) of the positional inputs."""
    out_spec: str
    """treespec (JSON) of the outputs, in RETURN order."""
    name: str = "program"
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        from dynvm.vm.verifier import verify

        verify(self)

    @property
    def regions(self) -> tuple[Region, ...]:
        regions = self._cache.get("regions")
        if regions is None:
            regions = self._cache["regions"] = compute_regions(self.code)
        return regions

    @property
    def constant_specs(self) -> tuple[ConstSpec, ...]:
        return tuple(ConstSpec(name, t.dtype, tuple(t.shape))
                     for name, t in zip(self.constant_names, self.constants))

    @property
    def content_hash(self) -> str:
        """sha256 over code, signature and constant bytes: equal programs, equal hash."""
        digest = self._cache.get("hash")
        if digest is None:
            digest = self._cache["hash"] = _content_hash(self)
        return digest


def _content_hash(program: Program) -> str:
    from dynvm.vm.serialize import encode_header

    h = hashlib.sha256()
    h.update(encode_header(program, with_hash=False))
    for tensor in program.constants:
        h.update(_tensor_bytes(tensor))
    return h.hexdigest()


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().cpu().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
