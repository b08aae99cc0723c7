"""The elementwise operations a generated kernel computes in registers, fp32 only.

Which ops, and their formulas, are the opcode table's `pointwise` field (see
dynvm.vm.ops_elementwise for the formulas and why they are written as they are); this
module turns an op of the specialized IR into the lines that compute it.
"""

from __future__ import annotations

from collections.abc import Callable

from dynvm.jit.ir import Literal, SpecOp
from dynvm.vm.isa import Pointwise
from dynvm.vm.opcodes import ALL_OPS


def _emitter(formula: str | Callable) -> Callable[[str, list[str], str], list[str]]:
    if callable(formula):
        return formula

    def emit(dst: str, ops: list[str], _mode: str) -> list[str]:
        names = dict(zip("ab", ops)) if len(ops) == 2 else {"x": ops[0]}
        return [f"{dst} = " + formula.format(**names)]
    return emit


_POINTWISE: dict[str, Pointwise] = {spec.name: spec.pointwise for spec in ALL_OPS
                                    if spec.pointwise is not None}
# opcode -> (number of value operands, emitter)
ELEMENTWISE: dict[str, tuple[int, Callable[[str, list[str], str], list[str]]]] = {
    name: (form.arity, _emitter(form.formula)) for name, form in _POINTWISE.items()}


def value_operands(op: SpecOp) -> tuple[object, ...]:
    """The operands an elementwise op computes with (GELU's mode is not one)."""
    arity, _ = ELEMENTWISE[op.opcode]
    return tuple(op.args[:arity])


def extra_of(op: SpecOp) -> str | None:
    """The op's mode operand, validated: GELU's approximation mode ('' for ops without
    one); None when the op has an unexpected operand list."""
    form = _POINTWISE[op.opcode]
    if form.modes:
        if len(op.args) != form.arity + 1 or op.args[form.arity] not in tuple(
                Literal(mode) for mode in form.modes):
            return None
        return op.args[form.arity].value
    return "" if len(op.args) == form.arity else None


def emit_lines(op: SpecOp, dst: str, operands: list[str]) -> list[str]:
    """The source lines computing `op` into `dst` from the operand expressions."""
    _, emit = ELEMENTWISE[op.opcode]
    return emit(dst, operands, extra_of(op) or "")


def describe(op: SpecOp, dst: str, operands: list[str]) -> str:
    """A one-line comment for the generated source: `t3 = gelu(t2, 'tanh')`."""
    extra = extra_of(op)
    args = ", ".join(operands) + (f", {extra!r}" if extra else "")
    return f"{dst} = {op.opcode.lower()}({args})"


def number(value: int | float) -> str:
    """A finite number as fp32 source text (parenthesized when negative)."""
    text = repr(float(value))
    return f"({text})" if text.startswith("-") else text
