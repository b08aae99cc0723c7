"""Ops computed from constants and literals alone, run once at compile time: a pass over
a specialized region.

Note [Shape constants in kernels]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An exact specialization knows every dim, so the specializer writes them as literals, and
what a model computes from its shapes alone is then computed from literals alone on
every call: BERT's attention-mask prologue (Hugging Face's `sdpa_mask`) makes three
ARANGEs, two ADDs of 0, nine UNSQUEEZEs, a FULL, a GE and a BITWISE_AND of the batch
and sequence indices before its one op that reads the mask, and its embeddings slice
and expand the position and token-type ids from constants: ~20 ATen calls a call, each
a few microseconds of dispatch for a few hundred bytes of result.

So ops of a pure opcode (`_PURE`: views, index arithmetic, comparisons, fills, gathers
and casts; nothing random, stateful or data-dependent in its shape) whose operands are
all constants, literals or such ops' results are run once when the kernel is built, and
each result a remaining op reads becomes a constant of the kernel (one `SHAPE_CONSTANT`
op handing it over, so every later pass still sees a register). Shape dims that vary
(a family's runtime params) are registers, so a family kernel folds only what does not
depend on them. Not folded:
- a result that leaves the region (the caller must get a fresh tensor);
- an in-place op, unless its target has no other reader and owns its storage (it is
  then run out of place, which the remaining ops cannot tell);
- anything in the storage of a value a remaining op writes in place (a constant must
  stay what it was built as);
- a result over `MAX_BYTES` a remaining op reads, unless it shares a program constant's
  storage (a view of a weight costs nothing to keep): its op runs on each call, from
  folded operands (at 8x128 BERT's token-type embeddings are 3 MB).
Each folded result is checked against the region's abstract values (shape, dtype and
strides at every probe) and the op kept where they differ. Results are the same bits:
the same ops on the same operands, run earlier.

Measured (BERT-base width, 4 layers, exact bf16 kernels in one process with and without
it, both with Note [Layer norm writing bf16 too], interleaved with an A/A, 25 rounds;
2026-12-06 05:30 UTC, load 1.9-2.1): 2x64 0.995, 4x64 1.014, 8x64 1.002 (A/A 1.011 /
1.032 / 0.992): within the noise, ~0.1 ms of dispatch in calls of 15-33 ms. Kept because
it is the same bits and fewer ops a call (21 of the prologue's); the bigger prize, the
token-type and position EMBEDDINGs of constant ids, is over `MAX_BYTES`: Note
[Embeddings of constant ids as views].

fp32 kernels fold the same way (`CpuOptions.shape_constants`, before fusion, as the bf16
lowering does): BERT-base's 22 prologue ops and both embeddings of constant ids leave
every exact fp32 kernel. In one process on / off (exact fp32 kernels, an A/A of two
"off" runtimes, interleaved call by call, 30 rounds; 2026-12-06 10:05 UTC, load
1.9-2.0): 1x16 0.956, 2x16 0.988, 1x64 0.983, 1x128 0.997, 8x128 0.988 (A/A
0.996-1.014), the same bits at all five shapes: ~0.5 ms a call, most of it at batch 1 x 16.

Note [Embeddings of constant ids as views]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
BERT's position ids are 0..S-1 and its token-type ids all 0, both constants of an exact
kernel, so their EMBEDDINGs gather the same rows of a constant table on every call
(2 x [B, S, 768] fp32 written a call: 0.35-0.6 ms of a 13.6-16.6 ms bf16 call at 1x64 /
2x64 / 1x128 with the word embedding, walls inside the kernel, 2026-12-06 07:35 UTC, load
1.9). Where the ids step through the table's rows by a fixed non-negative stride per dim
(0..S-1: one row per position; all 0: none), the gather is a strided view of the table
(`_rows_view`: checked element for element against the gather at compile time), and a
view of a weight is kept whatever its size. Its strides are not the gather's, so it is
taken only where every reader is an ADD / SUB / MUL writing a new tensor or into its
other operand, that operand dense and of the result's shape at every probe (the view's,
or one it broadcasts to: TensorIterator then lays the result out as that operand, as
before), and the probes then say the view's strides. The same bits: the readers add the
same values.
"""

from __future__ import annotations

import dataclasses

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, SpecOp, Var
from dynvm.jit.specialize import add_frees
from dynvm.vm.opcodes import OPCODES

SHAPE_CONSTANT = "SHAPE_CONSTANT"
MAX_BYTES = 1 << 16
"""A folded result a remaining op reads is kept as a constant up to this size (the Note)."""

_PURE = frozenset(name for name in (
    "ARANGE", "FULL", "ZEROS", "ONES", "FULL_LIKE", "ZEROS_LIKE", "ONES_LIKE",
    "SCALAR_TENSOR", "UNSQUEEZE", "SQUEEZE", "SQUEEZE_DIMS", "VIEW", "RESHAPE_IF", "EXPAND",
    "SLICE", "SELECT", "PERMUTE", "TRANSPOSE", "T", "ALIAS", "GATHER", "INDEX",
    "INDEX_SELECT", "EMBEDDING", "TO_COPY", "CLONE", "ADD", "SUB", "MUL", "DIV", "NEG",
    "GE", "GT", "LE", "LT", "EQ", "NE", "BITWISE_AND", "BITWISE_OR", "BITWISE_XOR",
    "BITWISE_NOT", "LOGICAL_AND", "LOGICAL_OR", "LOGICAL_NOT", "LOGICAL_XOR", "WHERE",
    "MASKED_FILL", "CAT", "STACK", "CUMSUM", "TRIL_INDICES", "TRIU_INDICES", "REPEAT")
    if name in OPCODES)


def shape_constant(value):
    """The kernel's constant, handed over as a register's value (the Note)."""
    return value


def _storage(value) -> int | None:
    if not isinstance(value, torch.Tensor) or value.device.type == "meta":
        return None
    try:
        return value.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _matches(value, abstract) -> bool:
    return (isinstance(value, torch.Tensor) and isinstance(abstract, torch.Tensor)
            and value.shape == abstract.shape and value.dtype == abstract.dtype
            and value.stride() == abstract.stride())


def _run(op: SpecOp, values: dict, constants, device: torch.device):
    """`op`'s results (one per dst) from known operands, or None where it cannot be run."""
    spec = OPCODES[op.opcode]
    if spec.impl is None or spec.writes_state or spec.data_dependent:
        return None

    def operand(arg):
        if isinstance(arg, Var):
            return values[arg.reg]
        if isinstance(arg, ConstRef):
            return constants[arg.index]
        if isinstance(arg, Literal):
            return device if isinstance(arg.value, torch.device) else arg.value
        if isinstance(arg, (list, tuple)):
            return type(arg)(operand(a) for a in arg)
        return arg
    try:
        result = spec.impl(*(operand(a) for a in op.args))
    except Exception:  # noqa: BLE001 - an op that refuses here runs on each call
        return None
    results = (result,) if len(op.dsts) == 1 else result
    if not isinstance(results, (tuple, list)) or len(results) != len(op.dsts) \
            or not all(isinstance(r, torch.Tensor) for r in results):
        return None
    return tuple(results)


_ELEMENTWISE = frozenset({"ADD", "SUB", "MUL"})   # readers a strided table view may have


def _rows_view(op: SpecOp, gathered: torch.Tensor, values: dict, constants):
    """Note [Embeddings of constant ids as views]: the EMBEDDING `op` (whose gather gave
    `gathered`) as a view of its constant table, or None."""
    weight, ids = op.args[0], op.args[1]
    if op.opcode != "EMBEDDING" or not isinstance(weight, ConstRef) \
            or not isinstance(ids, Var) or ids.reg not in values:
        return None
    table, ids = constants[weight.index], values[ids.reg]
    if not isinstance(table, torch.Tensor) or table.dim() != 2 or ids.numel() == 0 \
            or ids.dtype not in (torch.int64, torch.int32):
        return None
    origin = int(ids[(0,) * ids.dim()])
    steps = [int(ids.narrow(d, 1, 1)[(0,) * ids.dim()]) - origin if n > 1 else 0
             for d, n in enumerate(ids.shape)]
    if origin < 0 or any(step < 0 for step in steps):
        return None
    grid = torch.full(ids.shape, origin, dtype=torch.int64)
    for d, (n, step) in enumerate(zip(ids.shape, steps)):
        grid += (torch.arange(n) * step).view([n if i == d else 1 for i in range(ids.dim())])
    if not torch.equal(grid, ids.to(torch.int64)) or int(grid.max()) >= table.shape[0]:
        return None
    view = table.as_strided((*ids.shape, table.shape[1]),
                            (*(step * table.stride(0) for step in steps), table.stride(1)),
                            table.storage_offset() + origin * table.stride(0))
    return view if torch.equal(view, gathered) else None


def _dense_partner(reg: int, readers: list[int], ops, abstract) -> bool:
    """Every reader of `reg` an elementwise op writing into its other operand or a new
    tensor, that operand dense and of the result's shape (`reg`'s, or one it broadcasts
    to) at every probe (Note [Embeddings of constant ids as views])."""
    for position in readers:
        op = ops[position]
        if op.opcode not in _ELEMENTWISE or op.variant not in ("", "inplace") \
                or len(op.args) != 2 or (op.variant == "inplace" and op.args[0] == Var(reg)):
            return False
        others = [a for a in op.args if a != Var(reg)]
        if len(others) != 1 or not isinstance(others[0], Var):
            return False
        for probe in abstract:
            other, mine = probe.get(others[0].reg), probe.get(reg)
            if not isinstance(other, torch.Tensor) or not other.is_contiguous() \
                    or other.shape != torch.broadcast_shapes(other.shape, mine.shape):
                return False
    return True


def _meta_like(view: torch.Tensor) -> torch.Tensor:
    """A meta tensor with `view`'s shape, strides and dtype (a probe's value)."""
    size = 1 + sum((n - 1) * s for n, s in zip(view.shape, view.stride()) if n > 0)
    base = torch.empty(size, dtype=view.dtype, device="meta")
    return base.as_strided(view.shape, view.stride())


def fold_shape_constants(spec: SpecializedRegion, constants, device: torch.device, *,
                         variant: str) -> tuple[SpecializedRegion, str]:
    """`spec` with its ops over constants and literals alone run at compile time (Note
    [Shape constants in kernels]), and a note ("" where nothing was folded); the
    SHAPE_CONSTANT ops handing the results over are of `variant` (whose kernel table
    names `shape_constant`)."""
    if device.type != "cpu" or not spec.abstract:
        return spec, ""
    ops = list(spec.ops)
    leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    readers: dict[int, list[int]] = {}
    for position, op in enumerate(ops):
        for value in flat_values(op.args):
            if isinstance(value, Var):
                readers.setdefault(value.reg, []).append(position)
    values: dict[int, torch.Tensor] = {}
    viewed: dict[int, torch.Tensor] = {}   # registers now views of a table
    folded: set[int] = set()
    for position, op in enumerate(ops):
        if op.opcode not in _PURE or op.variant not in ("", "inplace") \
                or any(d in leaving for d in op.dsts) \
                or not all(v.reg in values for v in flat_values(op.args) if isinstance(v, Var)):
            continue
        if op.variant == "inplace":
            target = op.args[0]
            owner = next((ops[p] for p in range(position) if target.reg in ops[p].dsts), None)
            if readers.get(target.reg) != [position] or owner is None or owner.opcode in (
                    "SLICE", "SELECT", "EXPAND", "VIEW", "UNSQUEEZE", "SQUEEZE", "PERMUTE",
                    "TRANSPOSE", "T", "ALIAS", "RESHAPE_IF", "SQUEEZE_DIMS") \
                    or OPCODES[owner.opcode].is_view or OPCODES[owner.opcode].returns_operand:
                continue
        results = _run(op, values, constants, device)
        if results is None or not all(
                _matches(r, probe.get(d)) for probe in spec.abstract
                for d, r in zip(op.dsts, results)):
            continue
        view = _rows_view(op, results[0], values, constants)
        if view is not None and _dense_partner(op.dsts[0], readers.get(op.dsts[0], []),
                                               ops, spec.abstract):
            results = (view,)      # Note [Embeddings of constant ids as views]
            viewed[op.dsts[0]] = view
        values.update(zip(op.dsts, results))
        folded.add(position)
    constant_storages = {_storage(c) for c in constants if isinstance(c, torch.Tensor)}
    while True:
        kept = [p for p in range(len(ops)) if p not in folded]
        # a remaining op's in-place write into a folded value's storage unfolds it
        written = {_storage(values[op.args[0].reg]) for op in (ops[p] for p in kept)
                   if (op.variant == "inplace" or (op.opcode in OPCODES
                                                   and OPCODES[op.opcode].writes_state))
                   and op.args and isinstance(op.args[0], Var) and op.args[0].reg in values}
        needed = {v.reg for p in kept for v in flat_values(ops[p].args)
                  if isinstance(v, Var) and v.reg in values}
        unfold = {p for p in folded for d in ops[p].dsts
                  if _storage(values[d]) in written
                  or (d in needed and values[d].nbytes > MAX_BYTES
                      and _storage(values[d]) not in constant_storages)}
        if not unfold:
            break
        folded -= unfold
    if not folded:
        return spec, ""
    produced = {d for p in folded for d in ops[p].dsts}
    new_ops = []
    for position, op in enumerate(ops):
        if position in folded:
            new_ops.extend(SpecOp(SHAPE_CONSTANT, (d,), (Literal(values[d]),), op.source_pc,
                                  variant=variant)
                           for d in op.dsts if d in produced and d in needed)
            continue
        new_ops.append(op)
    new_ops = add_frees(new_ops, leaving)
    kept_constants = sum(1 for op in new_ops if op.opcode == SHAPE_CONSTANT)
    views = {d: v for d, v in viewed.items() if d in produced and d in needed}
    note = (f"; {len(folded)} op(s) over constants and literals run at compile time, "
            f"{kept_constants} shape constant(s) kept (Note [Shape constants in kernels])"
            + (f"; {len(views)} embedding(s) of constant ids as views of their table "
               "(Note [Embeddings of constant ids as views])" if views else ""))
    abstract = tuple({**probe, **{d: _meta_like(v) for d, v in views.items()}}
                     for probe in spec.abstract)
    return dataclasses.replace(spec, ops=tuple(new_ops), abstract=abstract), note
