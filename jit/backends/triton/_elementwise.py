"""The elementwise operations a generated kernel computes in registers, fp32 only.

Each entry turns operand expressions (local names, or inlined numbers) into the lines
that compute the result into `dst`. The formulas are torch's: GELU in its erf form
('none') and its tanh form, SiLU as x * sigmoid(x), ReLU that keeps NaN (torch.relu(nan)
is nan, so it is `where(x < 0, 0, x)`, not a maximum). tanh is written through exp
(1 - 2 / (exp(2x) + 1): exact at both ends, about 1e-7 absolute error near 0) because
`tl` has no tanh that both the CUDA backend and the interpreter provide.
"""

from __future__ import annotations

from collections.abc import Callable

from dynvm.jit.ir import Literal, SpecOp

SQRT_HALF = 0.7071067811865476          # 1 / sqrt(2)
SQRT_TWO_OVER_PI = 0.7978845608028654   # sqrt(2 / pi)


def _tanh(x: str) -> str:
    return f"1.0 - 2.0 / (tl.exp(2.0 * {x}) + 1.0)"


def _gelu(dst: str, ops: list[str], approximate: str) -> list[str]:
    (x,) = ops
    if approximate == "tanh":
        return [f"{dst}_inner = {SQRT_TWO_OVER_PI} * ({x} + 0.044715 * {x} * {x} * {x})",
                f"{dst} = 0.5 * {x} * (1.0 + ({_tanh(dst + '_inner')}))"]
    return [f"{dst} = 0.5 * {x} * (1.0 + tl.erf({x} * {SQRT_HALF}))"]


def _simple(template: str) -> Callable[[str, list[str], str], list[str]]:
    def emit(dst: str, ops: list[str], _extra: str) -> list[str]:
        names = dict(zip("ab", ops)) if len(ops) == 2 else {"x": ops[0]}
        return [f"{dst} = " + template.format(**names)]
    return emit


# opcode -> (number of value operands, emitter)
ELEMENTWISE: dict[str, tuple[int, Callable[[str, list[str], str], list[str]]]] = {
    "ADD": (2, _simple("{a} + {b}")),
    "SUB": (2, _simple("{a} - {b}")),
    "MUL": (2, _simple("{a} * {b}")),
    "DIV": (2, _simple("{a} / {b}")),
    "NEG": (1, _simple("-{x}")),
    "RELU": (1, _simple("tl.where({x} < 0.0, 0.0, {x})")),
    "SIGMOID": (1, _simple("tl.sigmoid({x})")),
    "SILU": (1, _simple("{x} * tl.sigmoid({x})")),
    "TANH": (1, _simple(_tanh("{x}"))),
    "EXP": (1, _simple("tl.exp({x})")),
    "LOG": (1, _simple("tl.log({x})")),
    "SQRT": (1, _simple("tl.sqrt({x})")),
    "RSQRT": (1, _simple("tl.rsqrt({x})")),
    "ABS": (1, _simple("tl.abs({x})")),
    "ERF": (1, _simple("tl.erf({x})")),
    "RECIPROCAL": (1, _simple("1.0 / {x}")),
    "GELU": (1, _gelu),
}


def value_operands(op: SpecOp) -> tuple[object, ...]:
    """The operands an elementwise op computes with (GELU's mode is not one)."""
    arity, _ = ELEMENTWISE[op.opcode]
    return tuple(op.args[:arity])


def extra_of(op: SpecOp) -> str | None:
    """The op's non-value operand, validated: GELU's approximation mode ('' for ops
    without one); None when the op has an unexpected operand list."""
    arity, _ = ELEMENTWISE[op.opcode]
    if op.opcode == "GELU":
        if len(op.args) != 2 or op.args[1] not in (Literal("none"), Literal("tanh")):
            return None
        return op.args[1].value
    return "" if len(op.args) == arity else None


def emit_lines(op: SpecOp, dst: str, operands: list[str]) -> list[str]:
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
