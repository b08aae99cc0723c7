"""A fused convolution's residual add written into the residual: a pass over a region
already fused and laid out channels-last.

Note [Residual add in place]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`mkldnn._convolution_pointwise.binary` (Note [CPU conv fusion]) allocates its result
on every call; its in-place overload `_convolution_pointwise_.binary` writes
conv(x) + other into `other` itself, as oneDNN's sum post-op does (the accumulator is
read and written in one pass, no new tensor). A ResNet bottleneck's residual dies at
its add, so the fused call may take it over, under conditions that make the overwrite
invisible:
- the call is the channels-last form (`CONV_BINARY`, inside a chain, Note
  [Channels-last chains]), so `other` has the layout the result must have;
- `other` is a fresh tensor: the result of another channels-last fused convolution of
  this region (never a live-in, a view or an arena block, and never a conversion that
  may return its operand);
- every op that reads `other` is such a fused convolution (which reads it as its input
  or its residual and makes no view of it), this call is the last of them, and `other`
  leaves the region neither as an output nor as this call's input `x` (conv(x) would
  read what it overwrites).
The result register then names `other`'s tensor; nothing reads `other` afterwards, so
no value changes under anyone. Weak guards have no chains, so no in-place residual.
"""

from __future__ import annotations

import dataclasses

import torch

from dynvm.jit.aliasing import flat_values
from dynvm.jit.backends.cpu.fusion import CONV_BINARY, CONV_UNARY, is_fused
from dynvm.jit.ir import SpecializedRegion, Var

CONV_BINARY_INPLACE = "ONEDNN_CONV_BINARY_INPLACE"
_CHAIN_CONVS = frozenset({CONV_UNARY, CONV_BINARY, CONV_BINARY_INPLACE})


def conv_binary_in_place(x, other, weight, bias, *rest):
    """`CONV_BINARY`'s operands, computed into `other` (returned)."""
    return torch.ops.mkldnn._convolution_pointwise_.binary(other, x, weight, bias, *rest)


IN_PLACE_KERNELS = {CONV_BINARY_INPLACE: conv_binary_in_place}


def residuals_in_place(spec: SpecializedRegion) -> tuple[SpecializedRegion, int]:
    """`spec` with each channels-last fused residual add that may write into its
    residual doing so (Note [Residual add in place]), and how many."""
    ops = list(spec.ops)
    leaving = {v.reg for _, v in spec.outputs if isinstance(v, Var)}
    producer: dict[int, int] = {d: i for i, op in enumerate(ops) for d in op.dsts}
    readers: dict[int, list[int]] = {}
    for position, op in enumerate(ops):
        for value in flat_values(op.args):
            if isinstance(value, Var):
                readers.setdefault(value.reg, []).append(position)
    rewritten = 0
    for position, op in enumerate(ops):
        if op.opcode != CONV_BINARY or not is_fused(op) or len(op.args) < 2:
            continue
        x, other = op.args[0], op.args[1]
        if not isinstance(other, Var) or other == x or other.reg in leaving:
            continue
        made_at = producer.get(other.reg)
        if made_at is None or ops[made_at].opcode not in _CHAIN_CONVS \
                or not is_fused(ops[made_at]):
            continue
        reads = readers.get(other.reg, [])
        if max(reads) != position or not all(
                ops[r].opcode in _CHAIN_CONVS and other not in ops[r].args[2:]
                for r in reads):
            continue
        ops[position] = dataclasses.replace(op, opcode=CONV_BINARY_INPLACE)
        rewritten += 1
    if not rewritten:
        return spec, 0
    return dataclasses.replace(spec, ops=tuple(ops)), rewritten
