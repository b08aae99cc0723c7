"""The opcode table: the single source of truth of the bytecode.

Each opcode is declared once, as an `OpSpec`, in one of the `ops_*` modules. Everything
that must agree on an opcode is derived from that declaration:

- the interpreter's dispatch (`impl`, called with the resolved operands, and `flow`),
- the shape functions (`shape_fn`, see Note [Shape functions]),
- the verifier (operand kinds `args`, result kinds `outs`),
- the text assembler and disassembler and the msgpack serializer (operand kinds),
- the frontend's lowering (`aten`: the ATen overloads the opcode stands for),
- the backends' per-op properties: the in-place form (`inplace`), the `out=` form
  (`out`), the formula a generated elementwise kernel computes (`pointwise`), and the
  alias facts (`is_view`: read from the ATen schema; `returns_operand`; `commutative`).
  They hold plain callables and data, so the VM imports nothing of the JIT.

tests/vm/test_isa_table.py checks that every opcode has every entry, and every field
against real execution.

Note [Shape functions]
~~~~~~~~~~~~~~~~~~~~~~
A shape function maps abstract operands to abstract results. An abstract tensor is a
tensor on the "meta" device: it has shape, dtype and strides but no data. For a tensor
or shape opcode the shape function is, by default, the opcode's own implementation run on
meta tensors (torch's meta kernels are the reference shape rules of ATen, so dynvm does
not restate them); device operands are replaced by "meta" for it, as the interpreter
replaces them by the runtime's device. An opcode whose result depends on tensor *data*
(ITEM, the condition of a branch) declares `data_dependent=True`; its shape function
returns `None` for the unknown value, and the JIT treats it as the end of what it can
fold. Tensor ops whose result *size* depends on data (NONZERO, ...) do the same; INDEX,
data-dependent only with a boolean mask, returns None only then (Note [Data-dependent
sizes] in dynvm.vm.ops_index).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from dynvm.vm.operands import ArgKind, ValueKind


class OpClass(enum.Enum):
    """The three classes of instructions of the design."""

    TENSOR = "tensor"
    SHAPE = "shape"
    CONTROL = "control"


class Flow(enum.Enum):
    """How an instruction moves the program counter."""

    NEXT = "next"                      # fall through to the next instruction
    JUMP = "jump"                      # go to its label
    BRANCH_IF_FALSE = "branch_if_false"  # go to its label when operand 0 is false
    RETURN = "return"                  # stop; operand 0 lists the outputs


class Outs(enum.Enum):
    """Result arity shapes that are not a fixed list of kinds."""

    VARIADIC_TENSORS = "T*"   # one or more tensors (SPLIT: as many as the graph uses)
    SAME_AS_ARG0 = "A"        # one result of the same kind as operand 0 (MOVE)


@dataclass(frozen=True, slots=True)
class OutForm:
    """An op's `out=` form, for results planned into an arena (Note [Arena layout])."""

    fn: Callable
    """(the opcode's operands..., out, scratch...) -> the result, written into `out`."""
    scratch: Callable | None = None
    """abstract operands -> the abstract scratch tensors `fn` also writes (layer norm's
    mean and rstd), or None when it needs none."""
    accepts: Callable | None = None
    """abstract operands -> whether this form applies to them (None: always)."""


@dataclass(frozen=True, slots=True)
class Pointwise:
    """How a generated elementwise kernel computes the op in registers (fp32, Triton).

    `formula` is a template over the value operands (`{x}` for one, `{a}`, `{b}` for
    two) giving the result, or a callable `(dst, operands, mode) -> lines` for a formula
    that needs temporaries or depends on a mode operand."""

    arity: int
    """How many leading operands are values (the rest is at most one mode literal)."""
    formula: str | Callable
    modes: tuple[str, ...] = ()
    """The accepted values of the mode operand after the values (GELU's approximation);
    empty for ops without one."""


@dataclass(frozen=True, slots=True)
class OpSpec:
    """One opcode of the ISA. See the module docstring for who reads which field."""

    name: str
    opclass: OpClass
    args: tuple[ArgKind, ...]
    outs: tuple[ValueKind, ...] | Outs
    doc: str
    impl: Callable | None = None
    flow: Flow = Flow.NEXT
    aten: tuple = ()
    is_view: bool = False
    """The result shares operand 0's storage (from the ATen schema's alias info)."""
    returns_operand: bool = False
    """The result may be operand 0 itself (MOVE; RESHAPE_IF when no reshape is needed)."""
    writes_state: bool = False
    """Writes operand 0, runtime state, in place (KV_APPEND; Note [KV cache as state] in
    dynvm.vm.ops_kv): never dropped as a no-op, even where its result is operand 0."""
    is_check: bool = False
    """Only validates its operands (no result): a specialization drops it where its
    guard proves it (SHAPE_ASSERT, DIMS_EQUAL, ASSERT_SCALAR)."""
    data_dependent: bool = False
    custom_shape_fn: Callable | None = field(default=None, repr=False)
    inplace: Callable | None = field(default=None, repr=False)
    """Same operands, result written over operand 0 (Note [In-place reuse]); only for
    ops whose result may have operand 0's shape and dtype."""
    commutative: bool = False
    """Operands 0 and 1 may be swapped without changing the result."""
    out: OutForm | None = field(default=None, repr=False)
    pointwise: Pointwise | None = field(default=None, repr=False)
    lower_operands: Callable | None = field(default=None, repr=False)
    """The ATen schema's argument values -> this opcode's operand values, for an opcode
    whose operands are not the schema's arguments in order (INDEX's `Tensor?[]`)."""

    @property
    def shape_fn(self) -> Callable:
        """Abstract evaluation of this opcode (see Note [Shape functions])."""
        if self.custom_shape_fn is not None:
            return self.custom_shape_fn
        if self.data_dependent:
            return _unknown_result
        if self.flow is not Flow.NEXT:
            return _no_result
        return self.impl


def _unknown_result(*_args):
    return None


def _no_result(*_args):
    return ()


_ARG_CODES = {kind.value: kind for kind in ArgKind}
_OUT_CODES = {"T": ValueKind.TENSOR, "S": ValueKind.SCALAR}


def parse_args(codes: str) -> tuple[ArgKind, ...]:
    """'T,T?,K' -> (TENSOR, TENSOR_OPT, IMM). The compact form keeps the table readable."""
    if not codes:
        return ()
    return tuple(_ARG_CODES[code.strip()] for code in codes.split(","))


def parse_outs(codes: str) -> tuple[ValueKind, ...] | Outs:
    """'T,S' -> (TENSOR, SCALAR); 'T*' and 'A' -> the `Outs` arity they name."""
    if codes in (o.value for o in Outs):
        return Outs(codes)
    if not codes:
        return ()
    return tuple(_OUT_CODES[code.strip()] for code in codes.split(","))


def op(name: str, opclass: OpClass, args: str, outs: str, doc: str, **fields) -> OpSpec:
    """Declare an opcode from the compact operand codes of `ArgKind`."""
    return OpSpec(name=name, opclass=opclass, args=parse_args(args), outs=parse_outs(outs),
                  doc=doc, **fields)
