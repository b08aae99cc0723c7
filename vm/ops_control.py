"""Control-flow instructions: jumps, branches, register moves at merges, return.

`torch.cond` lowers to JUMP_IF_FALSE / JUMP with MOVEs into the merged result registers;
`torch.while_loop` to a header that evaluates the condition, JUMP_IF_FALSE out of the
loop, the body, MOVEs of the carried values and a JUMP back to the header.
"""

from __future__ import annotations

from dynvm.vm.isa import Flow, OpClass, OpSpec, op


def _identity(value):
    return value


CONTROL_OPS: tuple[OpSpec, ...] = (
    op("JUMP", OpClass.CONTROL, "J", "", "continue at the label", flow=Flow.JUMP),
    op("JUMP_IF_FALSE", OpClass.CONTROL, "A,J", "",
       "continue at the label if the condition (bool, or one-element tensor) is false",
       flow=Flow.BRANCH_IF_FALSE),
    op("MOVE", OpClass.CONTROL, "A", "A", "copy a register (merges of branches and loops)",
       impl=_identity, custom_shape_fn=_identity, returns_operand=True),
    op("RETURN", OpClass.CONTROL, "TL", "", "end the program; the list holds the outputs",
       flow=Flow.RETURN),
)
