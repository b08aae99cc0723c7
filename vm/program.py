"""`Program`: the unit dynvm loads, saves, verifies and runs.

A program is code (a tuple of instructions), a register count, its constants (weights),
and its I/O signature: each input's name, dtype and dims (static or a named range), and
the pytree structure of the inputs and outputs. Inputs occupy registers 0..n_inputs-1;
the RETURN instruction lists the output registers. Constants are read through `Const`
operands and never copied into registers.

A program never depends on a concrete shape (see docs/ARCHITECTURE.md, Invariants). It is immutable;
its regions and content hash are derived once, on first use.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from dynvm.vm.input_check import derived_text
from dynvm.vm.instr import Instr
from dynvm.vm.regions import Region, compute_regions


@dataclass(frozen=True, slots=True)
class DimSpec:
    """One dim of an input: static (`low == high`, no name), dynamic in [low, high], or
    derived: `scale * name + offset`, torch.export's `a * Dim(...) + b`, within
    [low, high] (see Note [Derived dims] in dynvm.vm.input_check)."""

    name: str
    """The dim's name (a derived dim's: its root's), empty for a static dim."""
    low: int
    """The smallest size the dim may have."""
    high: int
    """The largest size the dim may have."""
    scale: int = 1
    """A derived dim's size is `scale * root + offset`; 1 for a plain dim."""
    offset: int = 0
    """See `scale`; 0 for a plain dim."""

    @property
    def is_static(self) -> bool:
        return self.low == self.high and not self.name

    @property
    def is_derived(self) -> bool:
        """True when the size is an expression of the named root, not the root itself."""
        return self.scale != 1 or self.offset != 0

    @property
    def expression(self) -> str:
        """The size as the user declared it: `32*k`, `2*n+1`, or the name alone."""
        return derived_text(self.name, self.scale, self.offset)

    def root_of(self, size: int) -> int | None:
        """The root's value for `size`, None when no root value gives it."""
        root, rest = divmod(size - self.offset, self.scale)
        return None if rest else root

    def root_range(self) -> tuple[int, int]:
        """The root's (low, high): the values that give sizes in [low, high]."""
        return (-(-(self.low - self.offset) // self.scale),
                (self.high - self.offset) // self.scale)

    def __str__(self) -> str:
        if self.is_static:
            return str(self.low)
        return f"{self.expression}:{self.low}..{self.high}"


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
        """The dims literal SHAPE_ASSERT carries: (low, high, name) per dim, and
        (low, high, name, scale, offset) for a derived one (Note [Derived dims])."""
        return tuple((d.low, d.high, d.name, d.scale, d.offset) if d.is_derived
                     else (d.low, d.high, d.name) for d in self.dims)


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
    state: tuple[int, ...] = ()
    """Indices of the inputs that are runtime state its owner allocates once and passes
    on every call, written in place by the program (Note [KV cache as state] in
    dynvm.vm.ops_kv); empty for a pure program."""
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
