"""Specialization: a region's instructions, rewritten for one signature or one family.

Given the abstract values of a region's live-ins at one or more probes (one probe for an
exact signature; several for a code family, see Note [Probes]), the specializer

1. evaluates the region abstractly (`dynvm.vm.abstract`) at every probe, so every
   register's shape, dtype and strides are known there;
2. folds shape instructions whose results are known into constants, and drops the input
   checks they prove (a guard re-establishes the same facts on every call);
3. drops views that became no-ops for these shapes (a VIEW or RESHAPE_IF to the same
   shape, an EXPAND to the same size, an identity PERMUTE, ...), and copies that cannot
   be observed (a CLONE of an already contiguous tensor that does not leave the region);
4. rewrites known patterns into the fused operations the backend has (attention's
   matmul / scale / softmax / matmul into one SDPA call);
5. records which registers die where, so generated code frees them as eager would, and
   lets elementwise operations overwrite a dying operand (Note [In-place reuse]).

The result, `SpecializedRegion`, is plain data that a backend turns into code. It
records whether the rewrite relied on the concrete shapes (then it needs a strong guard,
see Note [Guard strength]) and a note per rewrite, which `dynvm explain` shows.

Note [Probes]
~~~~~~~~~~~~~
A family kernel must be right for every signature of its family, whose varying dims
range over buckets. The specializer evaluates the region at a few probe shapes of the
family (its bucket bounds and points between, `Family.probe_dims`) and applies a rewrite
only where it holds at every probe: a shape value is folded only if it is the same at
all of them (otherwise the generated code computes it from the inputs at run time), a
view is dropped only if it is a no-op at all of them, a buffer is reused in place only
if shapes and dtypes match at all of them. A probe that one of the program's own checks
rejects stands for inputs the program refuses: the check stays in the code (so those
inputs are refused by the kernel too) and the probe is not used for anything else. The
first probe is the one memory is planned for (the bucket's upper bounds).

A family's buckets are in sizes, but a derived input dim (`32*k`, Note [Derived dims] in
dynvm.vm.input_check) takes only the sizes its root gives: a bucket's low end (65) and
the point after it are sizes the program refuses, and dropping them would leave too few
probes to vary anything. So a family's probes are first moved onto the root's grid
(`on_root_grid`): each derived dim to the next size its root gives, within the declared
range, a probe that lands on an earlier one one root step further; the family then
probes distinct root values, as it probes distinct sizes of a plain dim. A family's
guard checks each dim's bounds, not the grid, so the input check of a derived dim stays
in the family kernel (`_grid_checks`): a size within the bucket but off the grid is
refused by the kernel as by the interpreter.
"""

from __future__ import annotations

import dataclasses

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.background import checkpoint
from dynvm.jit.inplace import reuse_dying_buffers
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion, SpecOp, Value, Var
from dynvm.vm.abstract import CheckFailed, evaluate_region
from dynvm.vm.errors import DynvmError
from dynvm.vm.instr import Instr
from dynvm.vm.isa import OpClass, OpSpec, Outs, RowKind
from dynvm.vm.opcodes import OPCODES
from dynvm.vm.operands import Const, Imm, IntList, Reg, RegList
from dynvm.vm.regions import live_in_sets


class SpecializationError(DynvmError):
    """The signature cannot be specialized. Unless it is an `InputRejected`, this is a
    dynvm bug (a shape function or rewrite that disagrees with execution): the engine
    counts it by reason (Note [Failure accounting] in dynvm.jit.engine)."""


def failure_reason(error: BaseException) -> str:
    """One bug, one key (Note [Failure accounting]): the type of the root exception (a
    SpecializationError's cause) and the first line of its message."""
    root = error.__cause__ if isinstance(error, SpecializationError) and \
        error.__cause__ is not None else error
    lines = str(root).strip().splitlines()
    return f"{type(root).__name__}: {lines[0] if lines else ''}"[:240]


class InputRejected(SpecializationError):
    """The program's own input checks reject the signature, so every call with it raises
    in the interpreter too: nothing to compile, and no bug."""


def specialize(program, region, live_in_values: dict[int, object],
               extra_probes: tuple[dict[int, object], ...] = ()) -> SpecializedRegion:
    """Specialize `region` of `program` for live-ins with these (real or abstract)
    values, and for a family also for `extra_probes` (see Note [Probes])."""
    probes: list[dict[int, object]] = []
    kept_checks: set[int] = set()
    memo = ShapeMemo()
    candidates = (live_in_values, *extra_probes)
    if extra_probes:
        candidates = on_root_grid(program, candidates)
        kept_checks.update(_grid_checks(program, region))
    for index, live_in in enumerate(candidates):
        try:
            probes.append(evaluate_region(program, region, live_in, memo.apply))
        except CheckFailed as exc:
            if index == 0:
                raise InputRejected(f"region {region.index} rejects this signature: "
                                    f"{exc}") from exc
            kept_checks.add(exc.pc)
        except Exception as exc:  # a kernel's shape rule rejects it: no code for it
            raise SpecializationError(f"region {region.index} cannot run with this "
                                      f"signature: {type(exc).__name__}: {exc}") from exc
    reassigned = _reassigned(program, region)
    if reassigned:
        # Note [Reassigned registers]
        for probe in probes:
            for reg in reassigned:
                probe.pop(reg, None)
    rewriter = _Rewriter(program, region, probes, kept_checks)
    return rewriter.run()


def on_root_grid(program, probes) -> tuple[dict[int, object], ...]:
    """A family's probes with every derived input dim moved onto its root's grid
    (Note [Probes]); probes without a derived dim are returned as they are."""
    derived = {register: spec.dims for register, spec in enumerate(program.inputs)
               if any(d.is_derived for d in spec.dims)}
    if not derived or not any(r in derived for r in probes[0]):
        return tuple(probes)
    moved: list[dict[int, object]] = []
    seen: set[tuple] = set()
    for probe in probes:
        for step in (0, 1):
            candidate = dict(probe)
            for register, dims in derived.items():
                value = probe.get(register)
                if isinstance(value, torch.Tensor) and value.dim() == len(dims):
                    shape = [_grid_size(d, int(n), step) if d.is_derived else int(n)
                             for d, n in zip(dims, value.shape)]
                    candidate[register] = torch.empty(shape, dtype=value.dtype,
                                                      device=value.device)
            key = tuple((r, tuple(v.shape)) for r, v in candidate.items()
                        if isinstance(v, torch.Tensor))
            if key not in seen:
                seen.add(key)
                moved.append(candidate)
                break
    return tuple(moved)


def _grid_checks(program, region) -> set[int]:
    """The region's SHAPE_ASSERTs of inputs with a derived dim: a family's guard checks
    each dim's bounds, not its root's grid, so these stay in a family kernel (Note
    [Probes])."""
    return {pc for pc in range(region.start, region.stop)
            if program.code[pc].spec.is_input_check
            and any(len(dim) == 5 for dim in program.code[pc].args[4].value)}


def _grid_size(dim, size: int, step: int) -> int:
    """The size of `dim`'s root at `step` roots past the first one giving >= `size`,
    kept within the declared range."""
    low, high = dim.root_range()
    root = -(-(size - dim.offset) // dim.scale) + step
    return dim.scale * min(max(root, low), high) + dim.offset


class ShapeMemo:
    """Abstract evaluation's shape functions, memoized on their operands' metadata.

    Note [Shape memo]
    ~~~~~~~~~~~~~~~~~
    Most of a specialization's compile time was abstract evaluation (cProfile of the demo
    Transformer's family compiles: 2.1 of 3.1 s, 1.2 s of it in LAYER_NORM's meta
    function, which runs torch's Python reference decomposition), and a model repeats
    the same operation on the same shapes once per layer. A shape function is a pure
    function of its operands' shapes, strides, dtypes and values, so its result is kept
    under exactly those and rebuilt as fresh meta tensors: the six layers of an encoder
    are evaluated once per probe. Left out, because a fresh tensor would lose what they
    share with an operand: views and ops that may return an operand (they are cheap
    anyway), results at a storage offset, and anything not made of tensors and plain
    scalars. One memo serves one `specialize` call (all its probes).
    """

    def __init__(self) -> None:
        self._results: dict[tuple, object] = {}
        self.hits = 0

    def apply(self, instr: Instr, operands: list):
        # A checkpoint per instruction: abstract evaluation is Python from end to end,
        # tens of ms at BERT-base width, and a call beside it waits for the GIL (Note
        # [A compile worker's task and the GIL] in jit.background). Off a compile worker
        # (a synchronous compile) it returns at once.
        checkpoint()
        spec = instr.spec
        if spec.is_view or spec.returns_operand or spec.data_dependent:
            return spec.shape_fn(*operands)
        key = _operand_key(operands)
        if key is None or not any(isinstance(o, torch.Tensor) for o in operands):
            return spec.shape_fn(*operands)
        key = (spec.name, key)
        stored = self._results.get(key)
        if stored is not None:
            self.hits += 1
            return _rebuild(stored)
        results = spec.shape_fn(*operands)
        stored = _storable(results, operands)
        if stored is not None:
            self._results[key] = stored
        return results


_PLAIN = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format)


def _operand_key(value):
    """A hashable key of an operand's metadata, or None when it has none."""
    if isinstance(value, torch.Tensor):
        return ("T", tuple(value.shape), value.stride(), value.dtype, value.storage_offset())
    if isinstance(value, _PLAIN):
        return (type(value), value)      # 1, 1.0 and True are different operands
    if isinstance(value, list | tuple):
        items = [_operand_key(item) for item in value]
        return None if any(i is None for i in items) else (type(value), tuple(items))
    return None


def _storable(results, operands):
    """What `_rebuild` needs to make `results` again, or None when it cannot."""
    if isinstance(results, torch.Tensor):
        if results.storage_offset() != 0 or any(results is o for o in operands):
            return None
        return ("T", tuple(results.shape), results.stride(), results.dtype)
    if isinstance(results, bool | int | float | type(None)):
        return ("S", results)
    if type(results) in (tuple, list):    # not a structseq: rebuilt from a list
        items = [_storable(item, operands) for item in results]
        return None if any(i is None for i in items) else (type(results), items)
    return None


def _rebuild(stored):
    kind = stored[0]
    if kind == "T":
        _, shape, stride, dtype = stored
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    if kind == "S":
        return stored[1]
    return kind([_rebuild(item) for item in stored[1]])


def _reassigned(program, region) -> set[int]:
    """Registers the region writes more than once, or writes after reading them.

    Note [Reassigned registers]
    ~~~~~~~~~~~~~~~~~~~~~~~~~~~
    A probe maps each register to one abstract value: the last one written. Every rewrite
    reads it as *the* value of the register, which holds only if the register is written
    once in the region and not read before that write (a live-in it overwrites). The
    frontend emits such code, but hand-written or assembled programs may reuse a
    register: `%1 = UNSQUEEZE %0; %0 = RELU %1` made the UNSQUEEZE look like a no-op
    view ([1, n] -> [1, n]) and dropped it, so the region returned [n]. Such registers
    are left out of every probe (unknown): nothing is folded, dropped, fused, reused or
    planned on their account, and the code keeps the general operations."""
    written: set[int] = set()
    read_first: set[int] = set()
    found: set[int] = set()
    for pc in range(region.start, region.stop):
        instr = program.code[pc]
        for reg in instr.reads():
            if reg.index not in written:
                read_first.add(reg.index)
        for dst in instr.dsts:
            if dst.index in written or dst.index in read_first:
                found.add(dst.index)
            written.add(dst.index)
    return found


class _Rewriter:
    def __init__(self, program, region, probes: list[dict[int, object]],
                 kept_checks: set[int]) -> None:
        self.program = program
        self.region = region
        self.probes = probes
        self.values = probes[0]
        self.kept_checks = kept_checks
        self.varying = _varying_scalars(program, region, probes) if len(probes) > 1 else set()
        # register -> its value in the specialized code (Var, Literal or ConstRef)
        self.binding: dict[int, Value] = {r.index: Var(r.index) for r in region.live_in}
        self.ops: list[SpecOp] = []
        self.notes: list[str] = []
        self.assumes_shapes = False

    def run(self) -> SpecializedRegion:
        code = self.program.code
        for pc in range(self.region.start, self.region.stop):
            self.rewrite(pc, code[pc])
        outputs = tuple((r.index, self.binding[r.index]) for r in self.region.live_out)
        leaving = {v.reg for _, v in outputs if isinstance(v, Var)}
        ops = _fuse_attention(self.ops, self.notes, self.values, leaving)
        if len(ops) != len(self.ops):
            self.assumes_shapes = True
        live = live_in_sets(code)
        after = live[self.region.stop] if self.region.stop < len(code) else frozenset()
        ops = add_frees(ops, leaving)
        before = len(self.notes)
        ops = reuse_dying_buffers(ops, self.probes, self.notes, leaving)
        if len(self.notes) != before:
            self.assumes_shapes = True
        dead_live_ins = tuple(r.index for r in self.region.live_in if r not in after)
        return SpecializedRegion(self.region.index, tuple(r.index for r in self.region.live_in),
                                 tuple(ops), outputs, dead_live_ins, self.assumes_shapes,
                                 tuple(self.notes), len(self.region), tuple(self.probes))

    # -- one instruction ------------------------------------------------------------

    def operand(self, arg) -> object:
        if isinstance(arg, Reg):
            return self.binding[arg.index]
        if isinstance(arg, Const):
            return ConstRef(arg.index)
        if isinstance(arg, Imm):
            return Literal(arg.value)
        if isinstance(arg, IntList):
            items = [self.binding[i.index] if isinstance(i, Reg) else Literal(i)
                     for i in arg.items]
            if all(isinstance(i, Literal) for i in items):
                if any(isinstance(i, Reg) for i in arg.items):
                    self.assumes_shapes = True
                return Literal([i.value for i in items])
            return items
        if isinstance(arg, RegList):
            return [self.operand(i) for i in arg.items]
        raise TypeError(f"unexpected operand {arg!r}")

    def known(self, reg: Reg) -> bool:
        """A scalar with the same value at every probe, not computed from a varying dim."""
        value = self.values.get(reg.index)
        if value is None or isinstance(value, torch.Tensor) or reg.index in self.varying:
            return False
        return all(_same_literal(p.get(reg.index), value) for p in self.probes[1:])

    def rewrite(self, pc: int, instr: Instr) -> None:
        spec = instr.spec
        if spec.is_check:
            if pc not in self.kept_checks and all(self.is_static(a) for a in instr.args):
                self.assumes_shapes = True
                self.notes.append(f"{pc}: {instr.op} proven for this signature, dropped")
                return
        elif spec.opclass is OpClass.SHAPE and instr.dsts and all(
                self.known(d) for d in instr.dsts) and not spec.data_dependent:
            for dst in instr.dsts:
                self.binding[dst.index] = Literal(self.values[dst.index])
            self.assumes_shapes = True
            folded = ", ".join(f"%{d.index}={self.values[d.index]!r}" for d in instr.dsts)
            self.notes.append(f"{pc}: {instr.op} folded to {folded}")
            return
        if self.try_alias(pc, instr):
            return
        args = tuple(self.operand(a) for a in instr.args)
        opcode = instr.op
        if instr.spec.view_form is not None:
            opcode = self.reshape_variant(pc, instr)
        for dst in instr.dsts:
            self.binding[dst.index] = Var(dst.index)
        self.ops.append(SpecOp(opcode, tuple(d.index for d in instr.dsts), args, pc))

    def is_static(self, arg) -> bool:
        """Known at specialization time: a tensor's metadata (a check on it passed at
        every probe, which bound the family), or a scalar equal at every probe."""
        if isinstance(arg, Reg):
            value = self.values.get(arg.index)
            if isinstance(value, torch.Tensor):
                return True
            return self.known(arg)
        if isinstance(arg, IntList):
            return all(not isinstance(i, Reg) or self.known(i) for i in arg.items)
        return True

    def try_alias(self, pc: int, instr: Instr) -> bool:
        """Drop an instruction whose result is its first operand, unchanged."""
        if len(instr.dsts) != 1 or not instr.args or not isinstance(instr.args[0], Reg) \
                or instr.spec.writes_state:
            return False
        if not all(_unchanged(p.get(instr.args[0].index), p.get(instr.dsts[0].index))
                   for p in self.probes):
            return False
        op, spec = instr.op, instr.spec
        if spec.outs is Outs.SAME_AS_ARG0:   # MOVE: its result is its operand, any kind
            reason = "register move"
        elif spec.is_view or spec.returns_operand:
            reason = "no-op view for this shape"
        elif spec.is_copy and not self.may_escape(pc, instr.dsts[0]):
            reason = "copy of an already-laid-out tensor that never leaves the region"
        else:
            return False
        self.binding[instr.dsts[0].index] = self.binding[instr.args[0].index]
        self.assumes_shapes = True
        self.notes.append(f"{pc}: {op} dropped ({reason})")
        return True

    def may_escape(self, pc: int, reg: Reg) -> bool:
        """Whether `reg`, written at `pc`, or a view of it may outlive the region: then a
        copy into it must stay a copy (else an output could alias the caller's input)."""
        if reg in self.region.live_out:
            return True
        for instr in self.program.code[pc + 1:self.region.stop]:
            aliasing = instr.spec.is_view or instr.spec.returns_operand
            if aliasing and reg in instr.reads():
                return True
        return False

    def reshape_variant(self, pc: int, instr: Instr) -> str:
        """The instruction's view form (OpSpec.view_form: RESHAPE_IF -> VIEW) where its
        result is a view of its operand at every probe; else its own opcode."""
        for probe in self.probes:
            source = probe.get(instr.args[0].index)
            result = probe.get(instr.dsts[0].index)
            if not isinstance(source, torch.Tensor) or not isinstance(result, torch.Tensor):
                return instr.op
            try:
                source.view(result.shape)
            except RuntimeError:
                return instr.op  # it copies for this layout; keep the general form
        self.assumes_shapes = True
        self.notes.append(f"{pc}: {instr.op} is a view for this layout")
        return instr.spec.view_form


def _varying_scalars(program, region, probes: list[dict[int, object]]) -> set[int]:
    """Scalar registers that differ between probes, or are computed from one that does.

    Agreeing at every probe does not make the latter constant over the family: for n in
    [17, 64], `n == 40` is False at every probe but not at 40 (Note [Probes])."""
    varying: set[int] = set()
    for pc in range(region.start, region.stop):
        instr = program.code[pc]
        derived = any(r.index in varying for r in instr.reads())
        for dst in instr.dsts:
            first = probes[0].get(dst.index)
            if isinstance(first, torch.Tensor):
                continue
            if derived or not all(_same_literal(p.get(dst.index), first) for p in probes[1:]):
                varying.add(dst.index)
    return varying


def _same_literal(a, b) -> bool:
    return type(a) is type(b) and a == b


def _unchanged(source, result) -> bool:
    """The result is its source itself: same shape, strides, storage offset and dtype."""
    return (isinstance(source, torch.Tensor) and isinstance(result, torch.Tensor)
            and source.shape == result.shape and source.stride() == result.stride()
            and source.storage_offset() == result.storage_offset()
            and source.dtype == result.dtype)


def _uses(ops: list[SpecOp]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for op in ops:
        for value in flat_values(op.args):
            if isinstance(value, Var):
                counts[value.reg] = counts.get(value.reg, 0) + 1
    return counts



def _fuse_attention(ops: list[SpecOp], notes: list[str], values: dict[int, object],
                    leaving: set[int]) -> list[SpecOp]:
    """MATMUL(q, k with its last two dims swapped) -> MUL/DIV by a literal -> SOFTMAX over
    the last dim -> MATMUL(., v) becomes one SDPA call, when the intermediates have no
    other use (in the region or after it: `leaving` are the Vars the region outputs).

    The swap is a TRANSPOSE, or the PERMUTE that torch.export's core ATen decomposition
    turns `k.transpose(-2, -1)` into."""
    producers = {dst: op for op in ops for dst in op.dsts}
    uses = {reg: count + (reg in leaving) for reg, count in _uses(ops).items()}
    removed: set[int] = set()
    replacement: dict[int, SpecOp] = {}
    for final in ops:
        if not _batched_matmul(final) or not isinstance(final.args[0], Var):
            continue
        softmax = producers.get(final.args[0].reg)
        row = _spec(softmax).row if softmax is not None else None
        if row is None or row.kind is not RowKind.SOFTMAX:
            continue
        if uses.get(softmax.dsts[0]) != 1 or softmax.args[2] not in (Literal(None),
                                                                      Literal(False)):
            continue
        probs = values.get(softmax.dsts[0])
        if not isinstance(probs, torch.Tensor) or not _is_last_dim(softmax.args[1],
                                                                    probs.dim()):
            continue
        scaled = producers.get(softmax.args[0].reg) if isinstance(softmax.args[0], Var) else None
        scale_of = _spec(scaled).scale_of if scaled is not None else None
        if scale_of is None or uses.get(scaled.dsts[0]) != 1:
            continue
        if not isinstance(scaled.args[1], Literal) or not isinstance(scaled.args[0], Var):
            continue
        scale = scale_of(float(scaled.args[1].value))
        scores = producers.get(scaled.args[0].reg)
        if scores is None or not _batched_matmul(scores) or uses.get(scores.dsts[0]) != 1:
            continue
        kt = producers.get(scores.args[1].reg) if isinstance(scores.args[1], Var) else None
        if kt is None or uses.get(kt.dsts[0]) != 1 or not _swaps_last_two(kt, values):
            continue
        q, k, v = scores.args[0], kt.args[0], final.args[1]
        fused = SpecOp("SDPA", final.dsts, (q, k, v, Literal(None), Literal(0.0),
                                            Literal(False), Literal(scale)), final.source_pc)
        replacement[id(final)] = fused
        removed.update(id(op) for op in (softmax, scaled, scores, kt))
        notes.append(f"{scores.source_pc}-{final.source_pc}: attention (matmul, scale, "
                     "softmax, matmul) fused into one SDPA call")
    return [replacement.get(id(op), op) for op in ops if id(op) not in removed]


def _spec(op: SpecOp) -> OpSpec | None:
    """The table's entry of `op` (None for a backend's own opcode)."""
    return OPCODES.get(op.opcode)


def _batched_matmul(op: SpecOp) -> bool:
    """A matrix product of batched operands with no bias (MATMUL): attention's."""
    spec = _spec(op)
    return spec is not None and spec.gemm is not None and spec.gemm.b_batched \
        and spec.gemm.bias is None


def _is_last_dim(dim, rank: int) -> bool:
    return (isinstance(dim, Literal) and isinstance(dim.value, int) and rank > 0
            and dim.value % rank == rank - 1)


def _swaps_last_two(op: SpecOp, values: dict[int, object]) -> bool:
    """A view whose result is its operand with only the last two dims swapped."""
    result = values.get(op.dsts[0])
    if not isinstance(result, torch.Tensor) or result.dim() < 2:
        return False
    rank = result.dim()
    spec = _spec(op)
    if spec is None or spec.permutation is None or \
            not all(isinstance(a, Literal) for a in op.args[1:]):
        return False
    permutation = spec.permutation(rank, *(a.value for a in op.args[1:]))
    return permutation == (*range(rank - 2), rank - 1, rank - 2)


def add_frees(ops: list[SpecOp], keep: set[int]) -> list[SpecOp]:
    """Attach to each op the Vars whose last use it is (`keep`, the outputs, are never
    freed). Backend passes that move reads (the oneDNN fusions) call it again."""
    last_use: dict[int, int] = {}
    for position, op in enumerate(ops):
        for value in flat_values(op.args):
            if isinstance(value, Var):
                last_use[value.reg] = position
        for dst in op.dsts:
            last_use.setdefault(dst, position)
    frees: dict[int, list[int]] = {}
    for reg, position in last_use.items():
        if reg not in keep:
            frees.setdefault(position, []).append(reg)
    return [dataclasses.replace(op, frees=tuple(sorted(frees.get(i, ()))))
            for i, op in enumerate(ops)]

