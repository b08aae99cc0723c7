"""Typed instruction operands.

An instruction's operands are values of these few frozen classes; which class may stand
at which position is declared once per opcode in the ISA table (`ArgKind`), and the
verifier, assembler, disassembler and serializer all read that declaration.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from dynvm.vm.errors import VerifyError


@dataclass(frozen=True, slots=True)
class Reg:
    """A register of the frame: holds a tensor or a scalar (int, float, bool)."""

    index: int

    def __str__(self) -> str:
        return f"%{self.index}"


@dataclass(frozen=True, slots=True)
class Const:
    """A program constant (a weight or buffer), by its index in `Program.constants`."""

    index: int

    def __str__(self) -> str:
        return f"c{self.index}"


# Literal values an immediate may hold. Tuples hold literals of the same kinds.
IMM_TYPES = (type(None), bool, int, float, str, torch.dtype, torch.device, torch.layout,
             torch.memory_format, tuple)


@dataclass(frozen=True, slots=True, eq=False)
class Imm:
    """A literal known when the program is built: a number, flag, dtype, device, ...

    Equality includes the literal's type (`Imm(1) != Imm(True) != Imm(1.0)`), so a
    round trip through text or msgpack that changed a type would be caught.
    """

    value: object

    def __post_init__(self) -> None:
        _check_literal(self.value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Imm) and _typed(self.value) == _typed(other.value)

    def __hash__(self) -> int:
        return hash(_typed(self.value))


def _typed(value: object) -> object:
    if isinstance(value, tuple):
        return tuple(_typed(item) for item in value)
    if isinstance(value, float) and value != value:  # NaN equals itself as a literal
        return (float, "nan")
    return (type(value), value)


def _check_literal(value: object) -> None:
    if isinstance(value, tuple):
        for item in value:
            _check_literal(item)
    elif not isinstance(value, IMM_TYPES):
        raise VerifyError(f"an immediate cannot hold {type(value).__name__}: {value!r}")


@dataclass(frozen=True, slots=True)
class IntList:
    """A list of ints whose items are literal ints or scalar registers (symbolic sizes)."""

    items: tuple[int | Reg, ...]

    @property
    def is_static(self) -> bool:
        return all(isinstance(item, int) for item in self.items)


@dataclass(frozen=True, slots=True)
class RegList:
    """A list of tensor operands (registers or constants), e.g. the inputs of CAT."""

    items: tuple[Reg | Const, ...]


@dataclass(frozen=True, slots=True)
class Label:
    """A jump target: the index of an instruction in the program's code."""

    target: int

    def __str__(self) -> str:
        return f"@{self.target}"


Operand = Reg | Const | Imm | IntList | RegList | Label


class ArgKind(enum.Enum):
    """What an opcode accepts at one operand position."""

    TENSOR = "T"          # Reg or Const holding a tensor
    TENSOR_OPT = "T?"     # as TENSOR, or Imm(None)
    ANY = "A"             # Reg or Const (tensor or scalar), or a numeric/bool Imm
    SCALAR = "S"          # scalar Reg or numeric/bool Imm
    SCALAR_OPT = "S?"     # as SCALAR, or Imm(None)
    INTS = "L"            # IntList
    INTS_OPT = "L?"       # IntList or Imm(None)
    TENSORS = "TL"        # RegList
    IMM = "K"             # Imm (any literal)
    LABEL = "J"           # Label


class ValueKind(enum.Enum):
    """What a register holds; the verifier tracks one kind per register."""

    TENSOR = "tensor"
    SCALAR = "scalar"


def operand_matches(kind: ArgKind, operand: Operand) -> bool:
    """True if `operand` may stand at a position declared as `kind`."""
    match kind:
        case ArgKind.TENSOR:
            return isinstance(operand, Reg | Const)
        case ArgKind.TENSOR_OPT:
            return isinstance(operand, Reg | Const) or operand == Imm(None)
        case ArgKind.ANY:
            return isinstance(operand, Reg | Const) or _is_number_imm(operand)
        case ArgKind.SCALAR:
            return isinstance(operand, Reg) or _is_number_imm(operand)
        case ArgKind.SCALAR_OPT:
            return (isinstance(operand, Reg) or _is_number_imm(operand)
                    or operand == Imm(None))
        case ArgKind.INTS:
            return isinstance(operand, IntList)
        case ArgKind.INTS_OPT:
            return isinstance(operand, IntList) or operand == Imm(None)
        case ArgKind.TENSORS:
            return isinstance(operand, RegList)
        case ArgKind.IMM:
            return isinstance(operand, Imm)
        case ArgKind.LABEL:
            return isinstance(operand, Label)
    return False


def _is_number_imm(operand: Operand) -> bool:
    return isinstance(operand, Imm) and isinstance(operand.value, bool | int | float)


def registers_read(operand: Operand) -> tuple[Reg, ...]:
    """The registers an operand reads (constants are not registers)."""
    if isinstance(operand, Reg):
        return (operand,)
    if isinstance(operand, IntList):
        return tuple(item for item in operand.items if isinstance(item, Reg))
    if isinstance(operand, RegList):
        return tuple(item for item in operand.items if isinstance(item, Reg))
    return ()
