"""Horizontal linear fusion: linears with constant weights that read the same input
become one LINEAR over the weights stacked by rows and a SPLIT_WITH_SIZES of its result.

Note [Parallel linears as one]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
An attention block projects one input three times (Q, K, V) and a gated MLP twice
(gate, up). At one row each projection is a matrix-vector product of its own: a kernel
call, a dispatch and a pass over a weight that the next call could have streamed in the
same loop. One LINEAR over the rows of all of them [sum N_i, K] computes the same values
(each output column is the dot product of the input with one weight row, whichever
matrix that row sits in), and SPLIT_WITH_SIZES along the last dim gives each consumer
its columns as a view. At batch 1 decode in the bench Llama this is 3 -> 1 and 2 -> 1
GEMVs per layer; at a prompt chunk one GEMM of a wider N.

One copy of the weights: the stacked constant *replaces* the separate ones in the
constant pool (they are fused only where the LINEAR is their only reader, and no other
constant shares their storage). Where the weights came from a module's parameters
(`sources`), those parameters are rebound to row views of the stacked tensor, so the
process holds the weights once and not the module's copy beside the program's; a
second program exported from the same module then finds the weights already adjacent
rows of one storage and takes a view of it instead of stacking again (the prefill,
decode and step programs of a generator share one tensor). Values are bit-identical:
the same rows, the same products.

Where the two halves of a stacked gate and up projection feed only `silu(gate) * up`
(Llama's MLP), that is one SILU_MUL over the stacked result (dynvm.vm.ops_fused), with
no split. Only within one straight-line block, only where every register involved is written
once; a group is the linears of one input register with the same weight dtype, input
width and bias presence.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict

import torch

from dynvm.vm.frontend.rewrite import block_of, rebuild, writers_and_readers
from dynvm.vm.instr import Instr
from dynvm.vm.operands import Const, Imm, IntList, Reg, RegList

ENABLED = True
"""False turns the pass off: the A/B switch of benchmarks (bench/generate.py)."""


def _const_readers(code) -> Counter:
    counts: Counter = Counter()
    for instr in code:
        for arg in instr.args:
            items = arg.items if isinstance(arg, RegList) else (arg,)
            counts.update(item.index for item in items if isinstance(item, Const))
    return counts


def _whole_storage(t: torch.Tensor) -> bool:
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


def _stacked(parts: list[torch.Tensor]) -> tuple[torch.Tensor, bool]:
    """The parts stacked along dim 0, as a view where they already are adjacent rows of
    one storage (True), else a new tensor (False)."""
    first = parts[0]
    offset = first.storage_offset()
    adjacent = all(p.is_contiguous() and p.untyped_storage().data_ptr()
                   == first.untyped_storage().data_ptr() for p in parts)
    for p in parts:
        adjacent = adjacent and p.storage_offset() == offset
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    shape = (rows, *first.shape[1:])
    if adjacent and offset * first.element_size() <= first.untyped_storage().nbytes():
        return first.as_strided(shape, first.stride(), first.storage_offset()), True
    return torch.cat(parts, 0), False


def _rebind(sources: list, stacked: torch.Tensor) -> None:
    """Make each source parameter a row view of `stacked` (Note [Parallel linears as
    one]), where it owned its storage whole and holds those rows' values."""
    row = 0
    with torch.no_grad():
        for source in sources:
            if source is None:
                return
            n = source.shape[0]
            rows = stacked[row:row + n]
            if (_whole_storage(source) and source.shape == rows.shape
                    and source.dtype == rows.dtype and torch.equal(source, rows)):
                source.data = rows
            row += n


def _name(names: list[str]) -> str:
    prefix = os.path.commonprefix(names)
    prefix = prefix[:prefix.rfind(".") + 1]
    return f"{prefix}[{'+'.join(n[len(prefix):] for n in names)}]"


def _candidate(instr: Instr, constants, readers_of_const, shared, writers) -> tuple | None:
    """The group key of a fusable LINEAR, or None."""
    if instr.op != "LINEAR" or len(instr.dsts) != 1:
        return None
    x, w, b = instr.args
    if not isinstance(x, Reg) or not isinstance(w, Const) or len(writers[instr.dsts[0].index]) != 1:
        return None
    weight = constants[w.index]
    if weight.dim() != 2 or readers_of_const[w.index] != 1 or w.index in shared:
        return None
    if isinstance(b, Const):
        bias = constants[b.index]
        if (bias.dim() != 1 or bias.dtype != weight.dtype or readers_of_const[b.index] != 1
                or b.index in shared):
            return None
    elif b != Imm(None):
        return None
    return (x.index, weight.dtype, weight.device, weight.shape[1], isinstance(b, Const))


def fuse_parallel_linears(code, constants, names, n_regs, sources=None):
    """(code, constants, names, n_regs) with each group of LINEARs reading one input
    register fused (Note [Parallel linears as one]); `sources[i]` is the tensor constant
    i was taken from (a module parameter) or None. Unchanged where nothing fuses."""
    if not ENABLED:
        return tuple(code), tuple(constants), tuple(names), n_regs
    writers, readers = writers_and_readers(code)
    blocks = block_of(code)
    readers_of_const = _const_readers(code)
    by_storage = Counter(t.untyped_storage().data_ptr() for t in constants)
    shared = {i for i, t in enumerate(constants)
              if by_storage[t.untyped_storage().data_ptr()] > 1 and not _adjacent_only(
                  i, constants)}
    groups: dict[tuple, list[int]] = defaultdict(list)
    for pc, instr in enumerate(code):
        key = _candidate(instr, constants, readers_of_const, shared, writers)
        if key is not None and len(writers[key[0]]) <= 1:
            groups[(blocks[pc], *key)].append(pc)
    constants, names = list(constants), list(names)
    sources = list(sources) if sources is not None else [None] * len(constants)
    replaced: dict[int, list[Instr]] = {}
    dropped: set[int] = set()
    for pcs in groups.values():
        if len(pcs) < 2:
            continue
        linears = [code[pc] for pc in pcs]
        w_idx = [i.args[1].index for i in linears]
        b_idx = [i.args[2].index for i in linears if isinstance(i.args[2], Const)]
        weight, viewed = _stacked([constants[i] for i in w_idx])
        if not viewed:
            _rebind([sources[i] for i in w_idx], weight)
        bias_arg = Imm(None)
        if b_idx:
            bias, viewed = _stacked([constants[i] for i in b_idx])
            if not viewed:
                _rebind([sources[i] for i in b_idx], bias)
            constants.append(bias)
            names.append(_name([names[i] for i in b_idx]))
            sources.append(None)
            bias_arg = Const(len(constants) - 1)
        constants.append(weight)
        names.append(_name([names[i] for i in w_idx]))
        sources.append(None)
        fused = Reg(n_regs)
        n_regs += 1
        sizes = IntList(tuple(constants[i].shape[0] for i in w_idx))
        replaced[pcs[0]] = [
            Instr("LINEAR", (fused,), (linears[0].args[0], Const(len(constants) - 1), bias_arg)),
            Instr("SPLIT_WITH_SIZES", tuple(i.dsts[0] for i in linears), (fused, sizes, Imm(-1)))]
        for pc in pcs[1:]:
            replaced[pc] = []
        gated = _silu_mul(code, [i.dsts[0] for i in linears], sizes, readers, writers)
        if gated is not None:   # silu(gate) * up as one op over the stacked result
            silu_pc, mul_pc = gated
            replaced[pcs[0]] = replaced[pcs[0]][:1]
            replaced[silu_pc] = []
            replaced[mul_pc] = [Instr("SILU_MUL", code[mul_pc].dsts, (fused,))]
        dropped.update(w_idx + b_idx)
    if not replaced:
        return tuple(code), tuple(constants), tuple(names), n_regs
    code = rebuild(code, replaced)
    return _drop_constants(code, constants, names, dropped) + (n_regs,)


def _silu_mul(code, outs, sizes, readers, writers) -> tuple[int, int] | None:
    """(pc of SILU, pc of MUL) where two stacked linears of equal width feed only
    `MUL(SILU(first), second)` (a gated MLP), else None."""
    if len(outs) != 2 or sizes.items[0] != sizes.items[1]:
        return None
    first, second = outs
    if len(readers[first.index]) != 1 or len(readers[second.index]) != 1:
        return None
    silu_pc, mul_pc = readers[first.index][0], readers[second.index][0]
    silu, mul = code[silu_pc], code[mul_pc]
    if silu.op != "SILU" or silu.args != (first,) or mul.op != "MUL" or silu_pc > mul_pc:
        return None
    gate = silu.dsts[0]
    if (len(writers[gate.index]) != 1 or readers[gate.index] != [mul_pc]
            or set(mul.args) != {gate, second} or len(mul.args) != 2):
        return None
    return silu_pc, mul_pc


def _adjacent_only(index: int, constants) -> bool:
    """Whether constant `index` shares its storage only as disjoint rows (a view a
    previous fusion of the same module left: Note [Parallel linears as one])."""
    t = constants[index]
    ptr, start = t.untyped_storage().data_ptr(), t.storage_offset()
    end = start + t.numel()
    for j, other in enumerate(constants):
        if j == index or other.untyped_storage().data_ptr() != ptr:
            continue
        o_start = other.storage_offset()
        if o_start < end and start < o_start + other.numel():
            return False
    return t.is_contiguous()


def _drop_constants(code, constants, names, dropped: set[int]):
    keep = [i for i in range(len(constants)) if i not in dropped]
    index = {old: new for new, old in enumerate(keep)}

    def moved(arg):
        if isinstance(arg, Const):
            return Const(index[arg.index])
        if isinstance(arg, RegList):
            return RegList(tuple(Const(index[a.index]) if isinstance(a, Const) else a
                                 for a in arg.items))
        return arg

    code = tuple(Instr(i.op, i.dsts, tuple(moved(a) for a in i.args)) for i in code)
    return code, tuple(constants[i] for i in keep), tuple(names[i] for i in keep)
