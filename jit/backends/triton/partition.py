"""Partition a specialized region into fusion groups: what runs as one generated kernel,
what runs as a torch call. A pure function of the region, its constants and options.

Note [Fusion groups]
~~~~~~~~~~~~~~~~~~~~
Operations are taken in program order; each either joins the group that is open or
closes it and opens the next, so a group is a contiguous run of operations and the
groups run in program order (no reordering, so no dependence can be broken). Kinds:

- "elementwise": operations of `_elementwise.ELEMENTWISE` whose results all have one
  shape (the group's *domain*, compared at every probe). An operand is the domain's
  shape ("full"), a suffix of it after leading 1s ("broadcast": a bias [N] over
  [..., N], read at `offset % numel`), or a finite number literal. Any other
  broadcast is not fused.
- "row": one reduction over the last dim (SOFTMAX, SOFTMAX_ over dim -1; LAYER_NORM
  over the last dim with optional [N] weight and bias), with the elementwise group
  just before it as its prologue (a residual add before a layer norm) when its domain
  is the reduction's input shape, and elementwise operations on that shape after it as
  its epilogue. One program per row, the row in one block.
- "matmul": LINEAR (x @ w.T + b), MM, MATMUL with a 2-D right operand, ADDMM, with an
  epilogue of elementwise operations on the product's shape (bias, GELU, ReLU, a
  residual add, ...). A matmul with nothing to fuse runs as torch's matmul (the vendor
  library) when `TritonOptions.vendor_plain_matmul`, and the plan says so.
- "torch": everything else, one opcode implementation call per operation (views, SDPA,
  embedding, scalar arithmetic, other dtypes); each operation records why it was not
  fused.

Liveness: a value computed inside a group stays in registers unless something outside
the group reads it or it is a region output; then the kernel also stores it (a kernel
may have several outputs). Every tensor a kernel reads or writes is fp32 and contiguous
at every probe: other dtypes, and views that are not contiguous, run in torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dynvm.jit.backends.triton._elementwise import ELEMENTWISE, extra_of, value_operands
from dynvm.jit.backends.triton._facts import Facts, TensorFacts, is_number, next_power_of_two
from dynvm.jit.backends.triton.errors import UnsupportedRegion
from dynvm.jit.backends.triton.options import DEFAULT_OPTIONS, TritonOptions
from dynvm.jit.ir import Literal, SpecializedRegion, SpecOp, Var
from dynvm.vm.isa import Gemm, RowKind, RowOp
from dynvm.vm.opcodes import OPCODES

ELEMENTWISE_GROUP = "elementwise"
ROW_GROUP = "row"
MATMUL_GROUP = "matmul"
TORCH_GROUP = "torch"



def row_of(op: SpecOp) -> RowOp | None:
    """The row reduction `op` is (OpSpec.row: softmax, layer norm), or None."""
    spec = OPCODES.get(op.opcode)
    return spec.row if spec is not None else None


def gemm_of(op: SpecOp) -> Gemm | None:
    """The matrix product `op` is (OpSpec.gemm: its operands' roles), or None."""
    spec = OPCODES.get(op.opcode)
    return spec.gemm if spec is not None else None


@dataclass(frozen=True)
class FusionGroup:
    """A contiguous run of a region's operations that runs as one unit."""

    kind: str
    """"elementwise", "row", "matmul" (a generated kernel) or "torch" (opcode calls)."""
    ops: tuple[SpecOp, ...]
    stores: tuple[int, ...] = ()
    """Registers a kernel writes to memory (read later, or region outputs), in order."""
    anchor: int | None = None
    """Position in `ops` of the row reduction or the matmul; None otherwise."""
    reasons: tuple[str, ...] = ()
    """Torch groups: per operation, why it is not in a kernel."""


@dataclass
class _Open:
    kind: str
    positions: list[int]
    domain: tuple[tuple[int, ...], ...]
    anchor: int | None = None
    reasons: list[str] | None = None


def partition(spec: SpecializedRegion, constants: Sequence[object],
              options: TritonOptions = DEFAULT_OPTIONS) -> tuple[FusionGroup, ...]:
    """The region's operations as fusion groups, in program order (Note [Fusion
    groups]). `constants` are the program's constants (real or meta tensors)."""
    _check_single_assignment(spec)
    facts = Facts(spec, constants)
    closed: list[_Open] = []
    current: _Open | None = None
    for position, op in enumerate(spec.ops):
        fit = _classify(op, facts, options) if facts.probes else "no probes recorded"
        if current is not None and _joins(current, fit, op, facts):
            if isinstance(fit, _Fit) and fit.kind == ROW_GROUP:
                current.kind, current.anchor = ROW_GROUP, len(current.positions)
            current.positions.append(position)
            if current.kind == TORCH_GROUP:
                current.reasons.append(fit)
            continue
        if current is not None:
            closed.append(current)
        if isinstance(fit, str):
            current = _Open(TORCH_GROUP, [position], (), None, [fit])
        else:
            anchor = 0 if fit.kind != ELEMENTWISE_GROUP else None
            current = _Open(fit.kind, [position], fit.domain, anchor)
    if current is not None:
        closed.append(current)
    closed = _merge_torch_runs([_vendor(group, spec, options) for group in closed])
    return tuple(_finish(group, spec) for group in closed)


# -- what an operation can be part of ------------------------------------------------


@dataclass(frozen=True)
class _Fit:
    kind: str
    domain: tuple[tuple[int, ...], ...]


def _classify(op: SpecOp, facts: Facts, options: TritonOptions) -> _Fit | str:
    """The group kind `op` can be part of, or why it must run in torch."""
    if op.opcode in ELEMENTWISE:
        return _classify_elementwise(op, facts)
    if row_of(op) is not None:
        return _classify_row(op, facts, options)
    if gemm_of(op) is not None:
        return _classify_matmul(op, facts)
    return f"{op.opcode} has no generated kernel"


def _fp32_contiguous(info: TensorFacts | None) -> bool:
    return info is not None and info.dtype == torch.float32 and info.contiguous


def _suffix_of(small: tuple[int, ...], big: tuple[int, ...]) -> bool:
    stripped = small
    while stripped and stripped[0] == 1:
        stripped = stripped[1:]
    return len(small) <= len(big) and (not stripped or big[-len(stripped):] == stripped)


def operand_role(value, domain, facts: Facts) -> str | None:
    """"full", "broadcast", "scalar" for an operand a kernel over `domain` can read
    (Note [Fusion groups]); None when it cannot."""
    if is_number(value):
        return "scalar"
    info = facts.tensor(value)
    if not _fp32_contiguous(info):
        return None
    if info.shapes == domain:
        return "full"
    if all(_suffix_of(s, d) for s, d in zip(info.shapes, domain)):
        return "broadcast"
    return None


def _result(op: SpecOp, facts: Facts) -> TensorFacts | str:
    if len(op.dsts) != 1:
        return f"{op.opcode} has {len(op.dsts)} results"
    info = facts.tensor(Var(op.dsts[0]))
    if info is None:
        return f"{op.opcode}: result %{op.dsts[0]} is not a tensor known at every probe"
    if not _fp32_contiguous(info):
        return f"{op.opcode}: result is {info.dtype}, contiguous={info.contiguous} " \
               "(kernels are fp32 and contiguous only)"
    return info


def _classify_elementwise(op: SpecOp, facts: Facts) -> _Fit | str:
    out = _result(op, facts)
    if isinstance(out, str):
        return out
    if extra_of(op) is None:
        return f"{op.opcode}: unexpected operands {op.args!r}"
    roles = [operand_role(a, out.shapes, facts) for a in value_operands(op)]
    if None in roles:
        return f"{op.opcode}: an operand is not fp32-contiguous, a number, or broadcast " \
               "over trailing dims"
    if "full" not in roles:
        return f"{op.opcode}: no operand has the result's shape"
    return _Fit(ELEMENTWISE_GROUP, out.shapes)


def _classify_row(op: SpecOp, facts: Facts, options: TritonOptions) -> _Fit | str:
    out = _result(op, facts)
    if isinstance(out, str):
        return out
    x = facts.tensor(op.args[0])
    if not _fp32_contiguous(x) or x.shapes != out.shapes or x.rank == 0:
        return f"{op.opcode}: input is not an fp32 contiguous tensor of the result's shape"
    widest = max(shape[-1] for shape in x.shapes)
    if next_power_of_two(widest) > options.max_row_block:
        return f"{op.opcode}: rows of up to {widest} elements exceed max_row_block " \
               f"{options.max_row_block}"
    row = row_of(op)
    if row.kind is RowKind.SOFTMAX:
        dim = op.args[1]
        if not (isinstance(dim, Literal) and isinstance(dim.value, int)
                and dim.value % x.rank == x.rank - 1):
            return f"{op.opcode}: not over the last dim ({dim!r})"
        if op.args[2] != Literal(row.plain):
            return f"{op.opcode}: dtype conversion {op.args[2]!r} is not fused"
        return _Fit(ROW_GROUP, x.shapes)
    shape, weight, bias, eps = op.args[1:5]
    if not (isinstance(shape, Literal) and isinstance(shape.value, list | tuple)
            and len(shape.value) == 1 and all(s[-1] == shape.value[0] for s in x.shapes)):
        return f"LAYER_NORM: not over the last dim only ({shape!r})"
    for name, param in (("weight", weight), ("bias", bias)):
        info = facts.tensor(param)
        if param != Literal(None) and not (_fp32_contiguous(info) and all(
                s == (shape.value[0],) for s in info.shapes)):
            return f"LAYER_NORM: {name} is not None or an fp32 vector of the row's length"
    if not is_number(eps):
        return f"LAYER_NORM: eps {eps!r} is not a number"
    return _Fit(ROW_GROUP, x.shapes)


def matmul_operands(op: SpecOp) -> tuple[object, object, object]:
    """(a, b, bias or Literal(None)) of a matmul op, whatever its operand order."""
    gemm = gemm_of(op)
    bias = op.args[gemm.bias] if gemm.bias is not None and gemm.bias < len(op.args) \
        else Literal(None)
    return op.args[gemm.a], op.args[gemm.b], bias


def _classify_matmul(op: SpecOp, facts: Facts) -> _Fit | str:
    out = _result(op, facts)
    if isinstance(out, str):
        return out
    a_value, b_value, bias_value = matmul_operands(op)
    a, b = facts.tensor(a_value), facts.tensor(b_value)
    if not (_fp32_contiguous(a) and _fp32_contiguous(b)):
        return f"{op.opcode}: operands are not fp32 contiguous tensors"
    gemm = gemm_of(op)
    if b.rank != 2 or a.rank < gemm.a_min_rank or (gemm.a_2d and a.rank != 2):
        return f"{op.opcode}: ranks {a.rank} @ {b.rank} (a batched right operand) " \
               "are not fused"
    k_axis, n_axis = (1, 0) if gemm.b_is_nk else (0, 1)
    for sa, sb, so in zip(a.shapes, b.shapes, out.shapes):
        if sa[-1] != sb[k_axis] or so != (*sa[:-1], sb[n_axis]):
            return f"{op.opcode}: shapes {sa} @ {sb} -> {so} do not line up"
    if bias_value != Literal(None):
        role = operand_role(bias_value, out.shapes, facts)
        if role not in ("full", "broadcast"):
            return f"{op.opcode}: bias is not an fp32 tensor broadcast over the result"
        if gemm.bias_is_vector and role != "broadcast":
            return f"{op.opcode}: bias is not a vector"
    return _Fit(MATMUL_GROUP, out.shapes)


def _joins(group: _Open, fit: _Fit | str, op: SpecOp, facts: Facts) -> bool:
    if group.kind == TORCH_GROUP:
        return isinstance(fit, str)
    if isinstance(fit, str):
        return False
    if fit.kind == ELEMENTWISE_GROUP:
        return fit.domain == group.domain
    if fit.kind == ROW_GROUP and group.kind == ELEMENTWISE_GROUP:
        return fit.domain == group.domain   # the open group becomes the prologue
    return False


# -- closing groups ------------------------------------------------------------------


def _vendor(group: _Open, spec: SpecializedRegion, options: TritonOptions) -> _Open:
    if group.kind == MATMUL_GROUP and len(group.positions) == 1 and \
            options.vendor_plain_matmul:
        op = spec.ops[group.positions[0]]
        return _Open(TORCH_GROUP, group.positions, (), None,
                     [f"vendor library: {op.opcode} with nothing to fuse runs as torch's "
                      "matmul (cuBLAS on a GPU)"])
    return group


def _merge_torch_runs(groups: list[_Open]) -> list[_Open]:
    merged: list[_Open] = []
    for group in groups:
        if merged and group.kind == TORCH_GROUP and merged[-1].kind == TORCH_GROUP:
            merged[-1].positions.extend(group.positions)
            merged[-1].reasons.extend(group.reasons)
        else:
            merged.append(group)
    return merged


def _finish(group: _Open, spec: SpecializedRegion) -> FusionGroup:
    ops = tuple(spec.ops[p] for p in group.positions)
    if group.kind == TORCH_GROUP:
        return FusionGroup(TORCH_GROUP, ops, reasons=tuple(group.reasons))
    inside = set(group.positions)
    leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    readers = _readers(spec)
    stores = [dst for op in ops for dst in op.dsts
              if dst in leaving or readers.get(dst, set()) - inside]
    if not stores:  # nothing reads it: keep the last result anyway (never dead code)
        stores = [ops[-1].dsts[0]]
    return FusionGroup(group.kind, ops, tuple(stores), group.anchor)


def _readers(spec: SpecializedRegion) -> dict[int, set[int]]:
    readers: dict[int, set[int]] = {}
    for position, op in enumerate(spec.ops):
        for value in _flat(op.args):
            if isinstance(value, Var):
                readers.setdefault(value.reg, set()).add(position)
    return readers


def _flat(args):
    for arg in args:
        if isinstance(arg, list | tuple):
            yield from _flat(arg)
        else:
            yield arg


def _check_single_assignment(spec: SpecializedRegion) -> None:
    """Facts are per register, so each register must be written once in the region."""
    written = set(spec.live_in)
    for op in spec.ops:
        for dst in op.dsts:
            if dst in written:
                raise UnsupportedRegion(f"region {spec.region_index}: register %{dst} is "
                                        f"written more than once (op {op.opcode} at pc "
                                        f"{op.source_pc}); the Triton backend needs each "
                                        "register written once")
            written.add(dst)
