"""Abstract evaluation: the shape (and dtype, strides) of every register of a region,
given abstract live-ins, without touching data.

This is how "every tensor register's shape is known after each instruction" is made
concrete: the JIT runs it over a region for a signature's shapes to fold shape
arithmetic into constants and to size buffers. Tensors are meta tensors; scalars are
their values (or None when they depend on data); see Note [Shape functions].
"""

from __future__ import annotations

import torch

from dynvm.vm.errors import ShapeError
from dynvm.vm.operands import Const, Imm, IntList, Reg, RegList

_META = torch.device("meta")


def to_abstract(value):
    """A meta tensor with the same shape, dtype and strides; scalars pass through."""
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype,
                                   device=_META)
    return value


def _operand(arg, values: dict, constants):
    if isinstance(arg, Reg):
        return values[arg.index]
    if isinstance(arg, Const):
        return constants[arg.index]
    if isinstance(arg, Imm):
        return _meta_device(arg.value)
    if isinstance(arg, IntList):
        return [values[item.index] if isinstance(item, Reg) else item for item in arg.items]
    if isinstance(arg, RegList):
        return [_operand(item, values, constants) for item in arg.items]
    raise TypeError(f"no abstract value for operand {arg!r}")


def _meta_device(value):
    if isinstance(value, torch.device):
        return _META
    if isinstance(value, tuple):
        return tuple(_meta_device(v) for v in value)
    return value


class CheckFailed(ShapeError):
    """A program check (SHAPE_ASSERT, DIMS_EQUAL, ASSERT_SCALAR) rejects these values: the
    program would raise at instruction `pc` for every input like them."""

    def __init__(self, pc: int, error: ShapeError) -> None:
        super().__init__(f"instruction {pc}: {error}")
        self.pc = pc


def evaluate_region(program, region, live_in: dict[int, object],
                    apply=None) -> dict[int, object]:
    """Abstract values of every register the region reads or writes.

    `live_in` maps each live-in register index to a value (real or abstract). A value
    that depends on data comes out as None, and so does everything computed from it.
    Raises CheckFailed when one of the program's checks rejects the values. `apply(instr,
    operands)`, when given, stands for `instr.spec.shape_fn(*operands)` (the JIT passes a
    memo of it: jit.specialize.ShapeMemo).
    """
    constants = [to_abstract(c) for c in program.constants]
    values = {index: to_abstract(value) for index, value in live_in.items()}
    for pc in range(region.start, region.stop):
        instr = program.code[pc]
        spec = instr.spec
        if any(values.get(reg.index) is None for reg in instr.reads()):
            results = None  # computed from data we do not have
        else:
            try:
                operands = [_operand(a, values, constants) for a in instr.args]
                results = (spec.shape_fn(*operands) if apply is None
                           else apply(instr, operands))
            except ShapeError as exc:
                raise CheckFailed(pc, exc) from exc
        if len(instr.dsts) == 1:
            values[instr.dsts[0].index] = results
        else:
            for index, dst in enumerate(instr.dsts):
                values[dst.index] = None if results is None else results[index]
    return values

