"""The verifier: a program either passes, or VerifyError names the first instruction
that is wrong and why. Every program is verified when it is built, assembled or loaded,
so the interpreter and the JIT may assume well-formed code.

Checks, from the opcode table: operand count and kinds, result count, register and
constant indices in range, jump targets inside the code, control never falling off the
end, every read register defined on every path to it, and each register holding one kind
of value (tensor or scalar) throughout.
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
from dynvm.vm.regions import successors


def verify(program) -> None:
    code = program.code
    if not code:
        raise VerifyError("program has no instructions")
    n_regs, n_consts = program.n_regs, len(program.constants)
    if len(program.constant_names) != n_consts:
        raise VerifyError(f"{n_consts} constants but {len(program.constant_names)} names")
    if len(program.inputs) > n_regs:
        raise VerifyError(f"{len(program.inputs)} inputs but only {n_regs} registers")
    kinds: dict[int, ValueKind] = {i: ValueKind.TENSOR for i in range(len(program.inputs))}
    for pc, instr in enumerate(code):
        _check_instr(pc, instr, n_regs, n_consts, len(code), kinds)
    if code[-1].spec.flow not in (Flow.RETURN, Flow.JUMP):
        raise VerifyError(f"instruction {len(code) - 1} ({code[-1]}): control falls off "
                          "the end of the code (last instruction must be RETURN or JUMP)")
    _check_operand_kinds(code, kinds)
    _check_defined_before_use(program)


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
    written (or is an input) on every path from the entry to the reading instruction."""
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
    universe = frozenset(Reg(i) for i in range(program.n_regs))
    inputs = frozenset(Reg(i) for i in range(len(program.inputs)))
    defined_in: dict[int, frozenset[Reg]] = {}
    defined_out = [universe] * n  # top of the lattice; unreachable code stays there
    changed = True
    while changed:
        changed = False
        for pc in sorted(reachable):
            entry = inputs if pc == 0 else universe
            for p in preds[pc]:
                entry = entry & defined_out[p]
            defined_in[pc] = entry
            out = entry | frozenset(code[pc].dsts)
            if out != defined_out[pc]:
                defined_out[pc] = out
                changed = True
    for pc in sorted(reachable):
        instr = code[pc]
        for reg in instr.reads():
            if reg not in defined_in[pc]:
                raise _fail(pc, instr, f"reads {reg} before it is written on every path")
