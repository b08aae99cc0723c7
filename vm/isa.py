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
  alias facts (`is_view`: read from the ATen schema; `returns_operand`; `commutative`),
  and the CPU backend's: the oneDNN post-ops an op is as a fused epilogue
  (`onednn_unary`, `onednn_binary`) and its part in a channels-last chain
  (`channels_last`); and the roles the specializer's and backends' rewrites look for:
  a matrix product's operands (`gemm`), a row-wise reduction (`row`), a copy that may
  be dropped (`is_copy`), the view form of a reshape (`view_form`), a scaling by a
  literal (`scale_of`), a permutation of dims (`permutation`). They hold plain
  callables and data, so the VM imports nothing of the JIT, and no backend keeps a side
  table keyed by opcode name or compares opcode names.

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


class ChannelsLast(enum.Enum):
    """An op's part in a chain kept channels-last by the CPU backend (Note
    [Channels-last chains] in dynvm.jit.backends.cpu.channels_last)."""

    CONVOLUTION = "convolution"   # runs faster on NHWC: what a chain is for
    ELEMENTWISE = "elementwise"   # values ignore operand strides; NHWC carries through
    STRUCTURED = "structured"     # NHWC kernels of its own (batch norm, pooling, mean, cat)


@dataclass(frozen=True, slots=True)
class PostOp:
    """An activation as oneDNN's unary post-op of a fused GEMM or convolution (Note
    [CPU fusion] in dynvm.jit.backends.cpu.fusion), computed on the op's operand 0."""

    name: str
    """oneDNN's name of the post-op ("relu", "swish", "gelu", ...)."""
    scalars: int = 0
    """How many of the op's literal operands after the tensor oneDNN takes as the
    post-op's scalars, in order (LEAKY_RELU's slope, HARDTANH's bounds)."""
    algorithm: bool = False
    """Operand 1 (when given) is oneDNN's algorithm, not a scalar (GELU's approximate:
    "none" or "tanh")."""


@dataclass(frozen=True, slots=True)
class Gemm:
    """A matrix product's operands, by position: rows `a` [.., M, K] times `b` (and a
    `bias` added), as the backends that fuse or generate GEMMs read them."""

    a: int
    b: int
    bias: int | None = None
    """The bias operand's position; None for a product without one."""
    b_is_nk: bool = False
    """`b` is laid out [N, K] (LINEAR's weight), else [K, N]."""
    a_min_rank: int = 2
    """The least rank of `a` (LINEAR takes a vector)."""
    a_2d: bool = False
    """`a` is exactly 2-D (MM, ADDMM): no leading batch dims."""
    b_batched: bool = False
    """`b` may carry batch dims too (MATMUL broadcasts them)."""
    bias_is_vector: bool = False
    """The bias is one value per output column (LINEAR), never a full matrix."""


class RowKind(enum.Enum):
    """The row-wise reductions a generated row kernel computes."""

    SOFTMAX = "softmax"
    LAYER_NORM = "layer_norm"


@dataclass(frozen=True, slots=True)
class RowOp:
    """A reduction over each row of the last dim (one Triton program per row)."""

    kind: RowKind
    plain: object = None
    """SOFTMAX: operand 2's value when it asks for no dtype conversion (SOFTMAX's
    dtype None, SOFTMAX_'s half_to_float False)."""


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
    is_input_check: bool = False
    """Validates one program input against its declared signature, its dims (one
    (low, high, name[, root, step]) per dim, Note [Derived dims]) in operand 4."""
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
    onednn_unary: PostOp | None = None
    """The oneDNN post-op computing this activation as a fused epilogue."""
    onednn_binary: str | None = None
    """oneDNN's binary post-op ("add", "sub", "mul") computing this op of the fused
    result and a second tensor of its shape and dtype as an epilogue."""
    channels_last: ChannelsLast | None = None
    """Its part in a channels-last chain; None: a chain ends before it."""
    folds_into_conv: bool = False
    """An inference batch norm (operands: input, weight, bias, running mean and var,
    momentum, eps): with constant statistics it is a per-channel affine map that folds
    into the weight and bias of the convolution it follows."""
    gemm: Gemm | None = None
    """A matrix product: its operands' roles (the GEMMs the backends fuse or generate)."""
    row: RowOp | None = None
    """A reduction over each row of the last dim (a generated row kernel computes it)."""
    is_copy: bool = False
    """The result is a fresh copy of operand 0: where it equals operand 0 (shape,
    dtype, strides) and never leaves the region, it may be dropped."""
    view_form: str | None = None
    """The opcode this one is where its result can be a view of operand 0 (RESHAPE_IF:
    VIEW), which the specializer picks per layout."""
    scale_of: Callable | None = field(default=None, repr=False)
    """Operand 1 a number: the factor this op multiplies operand 0 by (MUL: itself;
    DIV: its reciprocal)."""
    permutation: Callable | None = field(default=None, repr=False)
    """(rank, literal operands after operand 0) -> the dims of operand 0 the result's
    dims are, in order, or None when the operands do not say (TRANSPOSE, PERMUTE)."""

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
