"""A causal LM's LM head stored input-major after export, for the GEMV that ends every
decode step (Note [LM head stored input-major])."""

# Note [LM head stored input-major]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A decode step at batch 1 is a chain of GEMVs, x [1, K] by each nn.Linear's W [N, K],
# and on one thread it is bound by reading the weights (~199 MB a token for the 768-wide
# 4-layer Llama of `dynvm bench generate`, half of it the 32000 x 768 LM head). MKL runs
# F.linear at M = 1 as a GEMV either way, but over the LM head it reads W^T stored
# contiguous ([K, N], input-major) faster than W stored [N, K]: the 17 GEMVs of that
# step, cycled so that they stream as in decoding, with only the LM head input-major
# 0.91x and 0.92x the time of all row-major (2026-12-05 07:10, load 1.3-1.8, 13-15
# interleaved rounds); the layers' weights input-major as well gave nothing more
# (all input-major 0.95x; the layers alone 1.02x).
#
# Why the LM head alone: it is the one linear that runs at M = rows whatever the prompt
# (the step keeps one position per row, `logits_to_keep`), so no prompt chunk ever
# multiplies it at M = 32..128, where torch's GEMM on input-major weights measured
# 7-10% slower than on row-major ones and the JIT's calibration would then put the
# chunk on oneDNN with a packed copy of the weight (the reason all LINEAR weights
# input-major, 4d91f43, was taken back: +94 MiB of packed copies after one B=1
# generation). At M = 4 torch on input-major is faster too (23.3 vs 28.1 ms for the
# 17 weights); from M = 16 the JIT's calibration picks oneDNN on either layout.
#
# So after export the LM head's constant is given input-major storage: the same values
# and shape, the tensor now the transpose of a contiguous [K, N] one
# (W.t().contiguous().t()), and the model's parameter is given the same tensor
# (`param.data`), so model and programs still hold one copy (a transient second one
# while it converts). A head tied to the input embeddings (GPT-2) keeps its layout:
# EMBEDDING gathers rows of it, which this layout would scatter; so does any head
# constant that some instruction other than LINEAR's weight operand reads. A program
# saved to a .dvm and loaded back may hold it contiguous again: it then runs as before,
# with the same values. A second export of the same model finds its head input-major
# already and gives the new programs that same tensor in place of the contiguous copy
# export made of it.

from __future__ import annotations

import dataclasses

import torch

from dynvm.vm.operands import Const
from dynvm.vm.program import Program


def _only_linear_weight(program: Program, index: int) -> bool:
    """Whether constant `index` is read as a LINEAR weight and by nothing else."""
    as_weight = False
    for instr in program.code:
        for position, arg in enumerate(instr.args):
            if isinstance(arg, Const) and arg.index == index:
                if instr.op != "LINEAR" or position != 1:
                    return False
                as_weight = True
    return as_weight


def _input_major(weight: torch.Tensor) -> bool:
    """Whether `weight` ([N, K]) is already stored input-major (a view of a [K, N] tensor)."""
    return not weight.is_contiguous() and weight.t().is_contiguous()


def _head_weight(model: torch.nn.Module) -> torch.Tensor | None:
    """The model's untied LM head weight, [vocab, hidden] fp32, contiguous or already
    input-major (a model exported before), or None."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or \
            weight.dtype != torch.float32 or not (weight.is_contiguous() or _input_major(weight)):
        return None
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    table = getattr(embeddings, "weight", None)
    if isinstance(table, torch.Tensor) and \
            table.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr():
        return None   # tied: EMBEDDING gathers its rows
    return weight


def store_lm_head_input_major(programs, model: torch.nn.Module):
    """`programs` (GeneratorPrograms) with the LM head's constant stored input-major and
    `model`'s LM head parameter given the same tensor (Note [LM head stored
    input-major]); unchanged where the head is tied, not fp32, or read otherwise."""
    weight = _head_weight(model)
    if weight is None:
        return programs
    key = (weight.data_ptr(), tuple(weight.shape))
    # A model exported before holds its head input-major already; export then gave the
    # programs a contiguous copy of it (as for any non-contiguous parameter), found by
    # its values and replaced by the model's tensor: one copy, the layout kept.
    again = _input_major(weight)
    found: dict[str, list[int]] = {}
    for field in ("step", "prefill", "decode"):
        program = getattr(programs, field)
        if program is None:
            continue
        indices = [i for i, t in enumerate(program.constants)
                   if (t.data_ptr(), tuple(t.shape)) == key or (
                       again and tuple(t.shape) == key[1] and t.dtype == weight.dtype
                       and torch.equal(t, weight))]
        if not all(_only_linear_weight(program, i) for i in indices):
            return programs   # some other instruction reads it: keep the layout
        if indices:
            found[field] = indices
    if not found:
        return programs
    if again:
        stored = weight.detach()
    else:
        with torch.no_grad():
            stored = weight.detach().t().contiguous().t()
            model.get_output_embeddings().weight.data = stored
    replaced = {}
    for field, indices in found.items():
        program = getattr(programs, field)
        constants = list(program.constants)
        for index in indices:
            constants[index] = stored
        replaced[field] = dataclasses.replace(program, constants=tuple(constants),
                                              _cache={})
    return dataclasses.replace(programs, **replaced)
