"""Rotary embedding as one op: Hugging Face's `q * cos + rotate_half(q) * sin` chain
becomes one ROTARY instruction.

Note [Rotary embedding as one op]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`apply_rotary_pos_emb` exports, per tensor, as seven instructions: `mul(x, cos)`, two
slices of x's halves, `neg`, `cat`, `mul(., sin)` and `add`: fourteen per layer for the
query and key, each a dispatch on a tensor of a few hundred values at decode. ROTARY
(dynvm.vm.ops_fused.rotary_embed) computes the same operations in the same order
(chunk, neg, cat, two multiplies, an add), bit for bit, as one instruction. It applies
where the slices split x's last dim in two equal halves and the cat puts the negated
second before the first along it, nothing else reads the chain's intermediates, and
cos, sin and the result have x's dtype and the result x's shape (so the kernel's
in-place steps are exact). Runs on the decomposed graph before lowering.
"""

from __future__ import annotations

import torch

from dynvm.vm.frontend.fx_chain import chains, finish, graph_modules, replace_chain
from dynvm.vm.ops_fused import rotary_embed

aten = torch.ops.aten

FUSED_CALLS = {rotary_embed: "ROTARY"}
"""The graph targets this pass writes -> the opcode each lowers to (ROTARY stands for no
ATen op, so it is not in the table's `aten` sources)."""
ENABLED = True
"""False turns the pass off: the A/B switch of benchmarks (bench/generate.py)."""


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _one_user(node) -> bool:
    return isinstance(node, torch.fx.Node) and len(node.users) == 1


def _mul_other(node, one):
    if not isinstance(node, torch.fx.Node) or node.target is not aten.mul.Tensor:
        return None
    if node.kwargs or len(node.args) != 2:
        return None
    a, b = node.args
    return b if a is one else a if b is one else None


def _half(node, x, last: int, start: int) -> bool:
    """`node` is `x[..., start:start + half]` along the last dim."""
    if not _one_user(node) or node.target is not aten.slice.Tensor or node.kwargs:
        return False
    args = list(node.args) + [None] * (5 - len(node.args))
    source, dim, begin, end, step = args[:5]
    size = _val(x).shape[-1]
    return (source is x and dim in (-1, last) and begin == start and step in (None, 1)
            and end is not None and min(end, size) == start + size // 2)


def _match(cat):
    """(x, cos, sin, the add node) for the chain around `cat`, or None."""
    parts, dim = (cat.args + (0,))[:2] if len(cat.args) == 1 else cat.args[:2]
    if cat.kwargs or len(parts) != 2 or not _one_user(cat):
        return None
    neg, first = parts
    if not _one_user(neg) or neg.target is not aten.neg.default:
        return None
    second = neg.args[0]
    x = first.args[0] if isinstance(first, torch.fx.Node) and first.args else None
    fake = _val(x)
    if not isinstance(fake, torch.Tensor) or fake.dim() == 0:
        return None
    last = fake.dim() - 1
    size = fake.shape[-1]
    if dim not in (-1, last) or not isinstance(size, int) or size % 2:
        return None
    if not (_half(first, x, last, 0) and _half(second, x, last, size // 2)):
        return None
    rotated = next(iter(cat.users))
    sin = _mul_other(rotated, cat)
    if sin is None or not _one_user(rotated):
        return None
    add = next(iter(rotated.users))
    if add.target is not aten.add.Tensor or add.kwargs or len(add.args) != 2:
        return None
    scaled = add.args[0] if add.args[1] is rotated else add.args[1]
    cos = _mul_other(scaled, x)
    if cos is None or not _one_user(scaled):
        return None
    out = _val(add)
    tensors = [_val(t) for t in (cos, sin)]
    if not all(isinstance(t, torch.Tensor) and t.dtype == fake.dtype for t in tensors):
        return None
    if out.shape != fake.shape or out.dtype != fake.dtype:
        return None
    return x, cos, sin, add


def fuse_rotary(graph_module) -> int:
    """Rewrite every rotary chain of `graph_module` (and its subgraphs) as one ROTARY
    node; returns how many (Note [Rotary embedding as one op])."""
    count = 0
    for module in graph_modules(graph_module) if ENABLED else ():
        graph = module.graph
        fused_here = 0
        for x, cos, sin, add in chains(graph, aten.cat.default, _match):
            replace_chain(graph, add, rotary_embed, (x, cos, sin), keep=(x, cos, sin))
            fused_here += 1
        finish(module, fused_here)
        count += fused_here
    return count
