"""A generator's LINEAR weights stored input-major, for the GEMVs of decoding at one
row (Note [Linear weights stored input-major])."""

# Note [Linear weights stored input-major]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A decode step at batch 1 is a chain of GEMVs, x [1, K] by nn.Linear's W [N, K]: on
# one thread it reads every weight once per token (~200 MB for the 768-wide 4-layer
# Llama of `dynvm bench generate`), and those reads are most of the step (14.6 of its
# 17.2 ms in the 29 linears, 18:38 UTC, load 3.9). MKL's sgemm at M = 1 reads W^T
# stored contiguous ([K, N], input-major) faster than W stored [N, K]: 13.7 against
# 14.6 ms over that model's 29 weights.
#
# The frontend keeps constants contiguous ([N, K]), so after export the generator
# gives each LINEAR weight constant of its programs input-major storage: the same
# values and shape, the tensor now the transpose of a contiguous [K, N] one
# (W.t().contiguous().t()). F.linear hands MKL the contiguous W^T; oneDNN's linear and
# its packing take the strides as they are. Programs that shared a storage share the
# new one, and the model's parameter that held it is given it too (`param.data`), so
# model and programs still hold one copy of the weights (a transient second copy while
# each weight converts). A constant some other instruction also reads (a tied
# embedding's table: EMBEDDING gathers rows, which this layout would scatter) keeps
# its layout. A program saved to a .dvm and loaded back may be contiguous again: it
# then runs as before, with the same results.

from __future__ import annotations

import dataclasses

import torch

from dynvm.vm.operands import Const
from dynvm.vm.program import Program


def _linear_weights(program: Program) -> set[int]:
    """Indices of the constants that are LINEAR weights and read by nothing else."""
    weights, other = set(), set()
    for instr in program.code:
        for position, arg in enumerate(instr.args):
            if isinstance(arg, Const):
                (weights if instr.op == "LINEAR" and position == 1 else other).add(arg.index)
    return weights - other


def store_linears_input_major(programs, model: torch.nn.Module | None = None):
    """`programs` (GeneratorPrograms) with every LINEAR weight constant stored
    input-major (Note [Linear weights stored input-major]); `model`'s parameters that
    held those storages are given the new ones. Values unchanged."""
    converted: dict[tuple, torch.Tensor] = {}   # (old data pointer, shape) -> new tensor
    replaced = {}
    for field in ("step", "prefill", "decode"):
        program = getattr(programs, field)
        if program is None:
            continue
        weights = _linear_weights(program)
        constants = list(program.constants)
        for index in weights:
            tensor = constants[index]
            if (tensor.dim() != 2 or not tensor.is_contiguous() or tensor.shape[0] == 1
                    or not tensor.is_floating_point()):
                continue
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key not in converted:
                converted[key] = tensor.t().contiguous().t()
            constants[index] = converted[key]
        if weights:
            replaced[field] = dataclasses.replace(program, constants=tuple(constants),
                                                  _cache={})
    if model is not None and converted:
        with torch.no_grad():
            for param in model.parameters():
                new = converted.get((param.data_ptr(), tuple(param.shape)))
                if new is not None and param.is_contiguous():
                    param.data = new
    return dataclasses.replace(programs, **replaced) if replaced else programs
