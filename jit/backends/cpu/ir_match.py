"""What the CPU backend's passes match in a specialized region's IR (fusion, conv,
precision): how often each register is read, a register's value at each probe, a
result's single consumer, an activation as oneDNN's post-op, whether ops in between
leave a pair's operands alone; and the ops run as the unfused kernel would, for the
calibration's questions."""

from __future__ import annotations

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.ir import ConstRef, Literal, SpecOp, Var
from dynvm.vm.opcodes import OPCODES

# Activation opcode -> oneDNN post-op attribute, and how many literal operands follow
# the tensor (they become the post-op's scalars; GELU's mode becomes its algorithm).
# The epilogues oneDNN computes, from the opcode table (OpSpec.onednn_unary / onednn_binary).
UNARY_POST_OPS = {name: spec.onednn_unary for name, spec in OPCODES.items()
                  if spec.onednn_unary is not None}
BINARY_POST_OPS = {name: spec.onednn_binary for name, spec in OPCODES.items()
                   if spec.onednn_binary is not None}


def use_counts(ops: list[SpecOp], leaving: set[int]) -> dict[int, int]:
    """Uses of each register in `ops` (a register in `leaving`, a region output,
    counts one more)."""
    counts = {reg: 1 for reg in leaving}
    for op in ops:
        for value in flat_values(op.args):
            if isinstance(value, Var):
                counts[value.reg] = counts.get(value.reg, 0) + 1
    return counts


def probe_tensors(probes, reg: int) -> list | None:
    """Register `reg`'s value at each probe, if it is a tensor at all of them."""
    values = [probe.get(reg) for probe in probes]
    return values if all(isinstance(v, torch.Tensor) for v in values) else None


def single_consumer(ops, position: int, uses) -> int | None:
    """The position of the one later op that reads op `position`'s result, or
    None when it has other uses (or leaves the region)."""
    dst = ops[position].dsts[0]
    if uses.get(dst) != 1:
        return None
    for later in range(position + 1, len(ops)):
        if any(v == Var(dst) for v in flat_values(ops[later].args)):
            return later
    return None


def unary_post_op(op: SpecOp) -> tuple[str, list, str] | None:
    """(attr, scalars, algorithm) of oneDNN's post-op computing activation `op` on its
    operand 0, or None when there is none."""
    post_op = UNARY_POST_OPS.get(op.opcode)
    if post_op is None:
        return None
    rest = op.args[1:]
    if not all(isinstance(a, Literal) for a in rest):
        return None
    if post_op.algorithm:   # GELU: operand 1 is oneDNN's algorithm
        mode = rest[0].value if rest else "none"
        return (post_op.name, [], mode) if mode in ("none", "tanh") and len(rest) <= 1 else None
    if len(rest) != post_op.scalars or not all(isinstance(a.value, int | float) for a in rest):
        return None
    return post_op.name, [float(a.value) for a in rest], ""


def untouched_between(ops, position: int, consumer_at: int, consumer: SpecOp) -> bool:
    """No op strictly between writes a register the fused call reads or defines, so that
    running it at `position` computes what the pair computed."""
    read = {v.reg for v in flat_values(ops[position].args) if isinstance(v, Var)}
    read |= {v.reg for v in flat_values(consumer.args) if isinstance(v, Var)}
    defined = set(consumer.dsts)
    for op in ops[position + 1:consumer_at]:
        if set(op.dsts) & (read | defined):
            return False
        if any(isinstance(v, Var) and v.reg in defined for v in flat_values(op.args)):
            return False
    return True


def run_original(ops: list[SpecOp], values: dict[int, object], constants) -> object:
    """Run `ops` as the unfused kernel would (in-place variants in place) on `values`
    (Var register -> tensor); returns the last op's first result. For calibration."""
    env = dict(values)

    def value(arg):
        if isinstance(arg, Var):
            return env[arg.reg]
        if isinstance(arg, ConstRef):
            return constants[arg.index]
        if isinstance(arg, Literal):
            return arg.value
        return [value(item) for item in arg]
    result = None
    for op in ops:
        spec = OPCODES[op.opcode]
        fn = spec.inplace if op.variant == "inplace" else spec.impl
        result = fn(*(value(arg) for arg in op.args))
        results = result if len(op.dsts) > 1 else (result,)
        env.update(zip(op.dsts, results))
    return env[ops[-1].dsts[0]]
