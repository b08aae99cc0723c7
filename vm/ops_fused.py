"""Instructions the frontend's fusion passes emit for patterns that ATen has no op for:
rotary position embedding (Note [Rotary embedding as one op] in
dynvm.vm.frontend.rotary)."""

from __future__ import annotations

import torch

from dynvm.vm.isa import OpClass, op


def rotary_embed(x, cos, sin):
    """`x * cos + rotate_half(x) * sin`, rotate_half along the last dim being
    `cat(-x[..., half:], x[..., :half])`: Hugging Face's `apply_rotary_pos_emb` for one
    tensor, with the same operations in the same order (equal bit for bit). The frontend
    emits it only where cos and sin broadcast to x's shape and share its dtype, so the
    in-place steps write x's shape and dtype as the out-of-place ones would."""
    first, second = x.chunk(2, -1)
    out = x * cos
    return out.add_(torch.cat((second.neg(), first), -1).mul_(sin))


FUSED_OPS = (
    op("ROTARY", OpClass.TENSOR, "T,T,T", "T",
       "rotary position embedding: x * cos + rotate_half(x) * sin", impl=rotary_embed),
)


def silu_mul(x):
    """`silu(x[..., :n]) * x[..., n:]` with n half the last dim: a gated MLP's gate and
    up projections computed as one stacked linear (Note [Parallel linears as one] in
    dynvm.vm.frontend.parallel_linears), the same two operations bit for bit."""
    gate, up = x.chunk(2, -1)
    return torch.nn.functional.silu(gate).mul_(up)


FUSED_OPS += (
    op("SILU_MUL", OpClass.TENSOR, "T", "T",
       "gated linear unit: silu of the first half of the last dim times the second half",
       impl=silu_mul),
)
