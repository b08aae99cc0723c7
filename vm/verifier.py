"""The verifier: a program either passes, or VerifyError names the first instruction
that is wrong and why. Every program is verified when it is built, assembled or loaded,
so the interpreter and the JIT may assume well-formed code.

Checks, from the opcode table: operand count and kinds, result count, register and
constant indices in range, jump targets inside the code, control never falling off the
end, every read register defined on every path to it, and each register holding one kind
of value (tensor or scalar) throughout.

The signature is checked too, not only the code (Note [Program signature]), and so are
the state inputs a stateful program writes in place (Note [KV cache as state] in
dynvm.vm.ops_kv): every cache operand of a KV instruction traces back to one.

Note [Program signature]
~~~~~~~~~~~~~~~~~~~~~~~~
Everything downstream trusts the declared signature: the HTTP parser validates requests
against it, the JIT buckets its dim ranges, the interpreter sizes each call's register
file from `n_regs`. A .dvm file whose content hash was recomputed after an edit passes
the checksum (it is an integrity check, not a proof of origin: see Note [Signed
programs] in dynvm.vm.dvm_signature), so the verifier checks the signature itself: input
names non-empty and unique (two inputs named alike would make a request's second one
silently replace the first); each dim 0 <= low <= high <= MAX_DIM (2**31 - 1: a bound of
2**62 would let a request declare a tensor no machine can allocate, and element counts
overflow int64), static dims unnamed, dynamic dims named, a dim name shared by several
inputs with one range; and `n_regs` at most MAX_UNUSED_REGS more
than the code's highest register (each call copies a register file of `n_regs` slots:
2**20 declared registers for 19 used cost 8 MB and milliseconds per call).
"""

from __future__ import annotations

from dynvm.vm.errors import VerifyError
from dynvm.vm.isa import Flow, Outs
from dynvm.vm.opcodes import OPCODES
from dynvm.vm.operands import (
    ArgKind,
    Const,
    Imm,
    IntList,
    Label,
    Reg,
    RegList,
    ValueKind,
    operand_matches,
)
from dynvm.vm.ops_custom import FUNCTIONAL_OPCODE, check_registered
from dynvm.vm.ops_custom import OPCODE as CUSTOM_OPCODE
from dynvm.vm.ops_kv import KV_CACHE_OPERANDS
from dynvm.vm.regions import successors

MAX_DIM = 2**31 - 1
"""Largest declared dim bound (Note [Program signature])."""
MAX_UNUSED_REGS = 64
"""Registers a program may declare beyond the highest one its code uses."""


def verify(program) -> None:
    """Raise VerifyError naming the first problem, unless `program` is well formed."""
    code = program.code
    if not code:
        raise VerifyError("program has no instructions")
    n_regs, n_consts = program.n_regs, len(program.constants)
    if len(program.constant_names) != n_consts:
        raise VerifyError(f"{n_consts} constants but {len(program.constant_names)} names")
    if len(program.inputs) > n_regs:
        raise VerifyError(f"{len(program.inputs)} inputs but only {n_regs} registers")
    _check_signature(program)
    kinds: dict[int, ValueKind] = {i: ValueKind.TENSOR for i in range(len(program.inputs))}
    for pc, instr in enumerate(code):
        _check_instr(pc, instr, n_regs, n_consts, len(code), kinds)
    _check_register_count(program)
    if code[-1].spec.flow not in (Flow.RETURN, Flow.JUMP):
        raise VerifyError(f"instruction {len(code) - 1} ({code[-1]}): control falls off "
                          "the end of the code (last instruction must be RETURN or JUMP)")
    _check_operand_kinds(code, kinds)
    _check_defined_before_use(program)
    _check_custom_ops(code)
    _check_state(program)


def _check_state(program) -> None:
    """Note [KV cache as state] in dynvm.vm.ops_kv: the state inputs are distinct inputs
    of rank 4, never overwritten, and every cache operand of a KV instruction is a
    state input or a KV_APPEND result chained from one."""
    state = program.state
    n_inputs = len(program.inputs)
    if not isinstance(state, tuple) or len(set(state)) != len(state) or not all(
            type(i) is int and 0 <= i < n_inputs for i in state):
        raise VerifyError(f"state {state!r}: expected distinct input indices "
                          f"0..{n_inputs - 1}")
    for index in state:
        if len(program.inputs[index].dims) != 4:
            raise VerifyError(f"state input {program.inputs[index].name!r}: expected "
                              "[slots, heads, capacity, head dim], got rank "
                              f"{len(program.inputs[index].dims)}")
    holds_state = set(state)
    for pc, instr in enumerate(program.code):
        for position in KV_CACHE_OPERANDS.get(instr.op, ()):
            operand = instr.args[position]
            if not (isinstance(operand, Reg) and operand.index in holds_state):
                raise _fail(pc, instr, f"operand {position} ({operand}) must be cache "
                            "state: a state input or a KV_APPEND of one")
        written = {reg.index for reg in instr.dsts} & set(state)
        if written:
            raise _fail(pc, instr, f"writes state input register(s) {sorted(written)}")
        if instr.op == "KV_APPEND":
            holds_state.update(reg.index for reg in instr.dsts)


def _check_custom_ops(code) -> None:
    """Note [Custom ops]: every custom op the code calls is registered here, with the
    schema the program was built for (UnregisteredOpError, at load rather than at call)."""
    for pc, instr in enumerate(code):
        if instr.op not in (CUSTOM_OPCODE, FUNCTIONAL_OPCODE):
            continue
        name, tensors, layout, schema, module = (getattr(a, "value", a)
                                                 for a in instr.args[:5])
        copied = instr.args[5].value if instr.op == FUNCTIONAL_OPCODE else ()
        count = len(tensors.items) if hasattr(tensors, "items") else -1
        if not (isinstance(name, str) and isinstance(schema, str) and isinstance(module, str)
                and _custom_layout_ok(layout, count) and isinstance(copied, tuple)
                and all(type(i) is int and 0 <= i < count for i in copied)):
            raise _fail(pc, instr, "a custom op call needs a name, a layout naming its "
                        f"{count} tensor operands, a schema and a module (Note [Custom ops])")
        check_registered(name, schema, module)


def _custom_layout_ok(layout, count: int) -> bool:
    if not isinstance(layout, tuple):
        return False
    for item in layout:
        if not (isinstance(item, tuple) and len(item) == 2):
            return False
        kind, value = item
        indices = (value,) if kind == "t" else value if kind == "tl" else ()
        if kind not in ("t", "tl", "v") or (kind == "tl" and not isinstance(value, tuple)) \
                or not all(type(i) is int and 0 <= i < count for i in indices):
            return False
    return True


def _check_signature(program) -> None:
    """Note [Program signature]: input names, dim bounds, shared dims."""
    seen: dict[str, int] = {}
    ranges: dict[str, tuple[int, int, str]] = {}
    for position, spec in enumerate(program.inputs):
        if not isinstance(spec.name, str) or not spec.name:
            raise VerifyError(f"input {position} has no name (a non-empty string)")
        if spec.name in seen:
            raise VerifyError(f"inputs {seen[spec.name]} and {position} are both named "
                              f"{spec.name!r}: input names must be unique")
        seen[spec.name] = position
        for axis, dim in enumerate(spec.dims):
            where = f"input {spec.name!r} dim {axis}"
            if not (type(dim.low) is int and type(dim.high) is int
                    and 0 <= dim.low <= dim.high <= MAX_DIM):
                raise VerifyError(f"{where}: bounds [{dim.low}, {dim.high}], expected "
                                  f"0 <= low <= high <= {MAX_DIM}")
            if dim.low != dim.high and not dim.name:
                raise VerifyError(f"{where}: a dynamic dim [{dim.low}, {dim.high}] needs "
                                  "a name")
            if not (type(dim.scale) is int and type(dim.offset) is int and dim.scale >= 1
                    and dim.root_of(dim.low) is not None
                    and dim.root_of(dim.high) is not None):
                raise VerifyError(f"{where}: derived dim {dim.expression} with bounds "
                                  f"[{dim.low}, {dim.high}], expected a scale >= 1 and "
                                  "bounds it gives (Note [Derived dims])")
            if dim.name:
                # Dims sharing a name share a root: its range must agree.
                root_low, root_high = dim.root_range()
                low, high, first = ranges.setdefault(dim.name, (root_low, root_high, spec.name))
                if (low, high) != (root_low, root_high):
                    raise VerifyError(f"{where}: dim {dim.name!r} is [{root_low}, "
                                      f"{root_high}] here but [{low}, {high}] in input "
                                      f"{first!r}")


def _check_register_count(program) -> None:
    highest = len(program.inputs) - 1
    for instr in program.code:
        for reg in (*instr.reads(), *instr.dsts):
            highest = max(highest, reg.index)
    if program.n_regs > highest + 1 + MAX_UNUSED_REGS:
        raise VerifyError(f"program declares {program.n_regs} registers but its code uses "
                          f"registers up to %{highest} only (at most {MAX_UNUSED_REGS} "
                          "unused registers allowed)")


def _fail(pc: int, instr, message: str) -> VerifyError:
    return VerifyError(f"instruction {pc} ({instr.op}): {message}")


def _check_instr(pc, instr, n_regs, n_consts, n_code, kinds) -> None:
    spec = OPCODES.get(instr.op)
    if spec is None:
        raise VerifyError(f"instruction {pc}: unknown opcode {instr.op!r}")
    if len(instr.args) != len(spec.args):
        raise _fail(pc, instr, f"takes {len(spec.args)} operands, got {len(instr.args)}")
    for position, (kind, arg) in enumerate(zip(spec.args, instr.args)):
        if not operand_matches(kind, arg):
            raise _fail(pc, instr, f"operand {position} must be {kind.name}, got {arg!r}")
        _check_indices(pc, instr, arg, n_regs, n_consts, n_code)
    for dst in instr.dsts:
        if not isinstance(dst, Reg) or not 0 <= dst.index < n_regs:
            raise _fail(pc, instr, f"result {dst!r} is not a register below {n_regs}")
    for dst, kind in zip(instr.dsts, _result_kinds(pc, instr, spec, kinds), strict=True):
        previous = kinds.setdefault(dst.index, kind)
        if previous is not kind:
            raise _fail(pc, instr, f"writes a {kind.value} to {dst}, which holds a "
                                   f"{previous.value} elsewhere")


def _result_kinds(pc, instr, spec, kinds) -> tuple[ValueKind, ...]:
    if spec.outs is Outs.VARIADIC_TENSORS:
        if not instr.dsts:
            raise _fail(pc, instr, "needs at least one result register")
        return (ValueKind.TENSOR,) * len(instr.dsts)
    if spec.outs is Outs.SAME_AS_ARG0:
        if len(instr.dsts) != 1:
            raise _fail(pc, instr, f"has 1 result, got {len(instr.dsts)}")
        source = instr.args[0]
        if isinstance(source, Const):
            return (ValueKind.TENSOR,)
        if isinstance(source, Imm):
            return (ValueKind.SCALAR,)
        # A register defined later in code order (a loop back-edge) gets its kind there;
        # _check_operand_kinds checks both agree.
        return (kinds.get(source.index, ValueKind.TENSOR),)
    if len(instr.dsts) != len(spec.outs):
        raise _fail(pc, instr, f"has {len(spec.outs)} results, got {len(instr.dsts)}")
    return spec.outs


def _check_indices(pc, instr, arg, n_regs, n_consts, n_code) -> None:
    items = arg.items if isinstance(arg, IntList | RegList) else (arg,)
    for item in items:
        if isinstance(item, Reg) and not 0 <= item.index < n_regs:
            raise _fail(pc, instr, f"register {item} out of range (program has {n_regs})")
        if isinstance(item, Const) and not 0 <= item.index < n_consts:
            raise _fail(pc, instr, f"constant {item} out of range (program has {n_consts})")
        if isinstance(item, Label) and not 0 <= item.target < n_code:
            raise _fail(pc, instr, f"bad jump target {item} (code has {n_code} instructions)")


def _check_operand_kinds(code, kinds) -> None:
    for pc, instr in enumerate(code):
        for kind, arg in zip(instr.spec.args, instr.args):
            if kind in (ArgKind.TENSOR, ArgKind.TENSOR_OPT, ArgKind.TENSORS):
                want = ValueKind.TENSOR
            elif kind in (ArgKind.SCALAR, ArgKind.SCALAR_OPT, ArgKind.INTS, ArgKind.INTS_OPT):
                want = ValueKind.SCALAR
            else:
                continue
            items = arg.items if isinstance(arg, IntList | RegList) else (arg,)
            for item in items:
                if isinstance(item, Reg) and item.index in kinds and kinds[item.index] is not want:
                    raise _fail(pc, instr, f"operand {item} holds a {kinds[item.index].value}, "
                                           f"expected a {want.value}")
        if instr.op == "MOVE" and isinstance(instr.args[0], Reg):
            source = kinds.get(instr.args[0].index)
            if source is not None and source is not kinds[instr.dsts[0].index]:
                raise _fail(pc, instr, f"moves a {source.value} into a register holding a "
                                       f"{kinds[instr.dsts[0].index].value}")


def _check_defined_before_use(program) -> None:
    """Forward 'must be defined' dataflow: a read is legal only if the register is
    written (or is an input) on every path from the entry to the reading instruction.

    Register sets are bit masks (bit i: register i), so joining two sets costs
    n_regs / 64 machine words instead of a frozenset's n_regs hash operations: with
    frozensets this check was quadratic in the code's length (a 2000-instruction
    straight-line program took 0.64 s to verify, at load as at compile)."""
    code = program.code
    n = len(code)
    succ = [successors(code, pc) for pc in range(n)]
    preds: list[list[int]] = [[] for _ in range(n)]
    for pc in range(n):
        for s in succ[pc]:
            preds[s].append(pc)
    reachable: set[int] = set()
    stack = [0]
    while stack:
        pc = stack.pop()
        if pc not in reachable:
            reachable.add(pc)
            stack.extend(succ[pc])
    order = sorted(reachable)
    universe = (1 << program.n_regs) - 1
    inputs = (1 << len(program.inputs)) - 1
    writes = [_mask(code[pc].dsts) for pc in range(n)]
    defined_in: dict[int, int] = {}
    defined_out = [universe] * n  # top of the lattice; unreachable code stays there
    changed = True
    while changed:
        changed = False
        for pc in order:
            entry = inputs if pc == 0 else universe
            for p in preds[pc]:
                entry &= defined_out[p]
            defined_in[pc] = entry
            out = entry | writes[pc]
            if out != defined_out[pc]:
                defined_out[pc] = out
                changed = True
    for pc in order:
        instr = code[pc]
        for reg in instr.reads():
            if not defined_in[pc] >> reg.index & 1:
                raise _fail(pc, instr, f"reads {reg} before it is written on every path")


def _mask(regs) -> int:
    mask = 0
    for reg in regs:
        mask |= 1 << reg.index
    return mask
