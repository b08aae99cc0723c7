"""RMS norm as one op: the decomposed pattern Hugging Face's Llama, Qwen2 and Mistral
(and T5-style) norms export to becomes one `aten.rms_norm` node, which lowers to RMS_NORM.

Note [RMS norm as one op]
~~~~~~~~~~~~~~~~~~~~~~~~~
`LlamaRMSNorm.forward` is written out in tensor ops, so the exported graph holds, per
norm, `x32 = x.to(float32)` (absent when x already is), `pow(x32, 2)`,
`mean(-1, keepdim=True)`, `add(eps)`, `rsqrt`, `mul(x32, r)`, `to(x.dtype)` (absent
likewise) and `mul(weight, .)`: six to eight instructions, each a dispatch and a pass
over the row. For a float32 (or float64) x, ATen's `rms_norm(x, [D], weight, eps)`
computes exactly that chain: equal bit for bit (checked at widths 5 to 8192 on this
project's torch; multiplication commutes). It applies only where that is the graph's
definition: the norm of a float32 or float64 value (a half x's upcast; its cast back
and the weight then stay as written: torch's kernel scales a half input by the weight
before its cast back, Hugging Face after, and the roundings differ), the mean over the
last dim alone, a weight of one value per element of that dim
(or none), and no intermediate read by anything else. Runs on the decomposed graph
before lowering.
"""

from __future__ import annotations

import torch

from dynvm.vm.frontend.fx_chain import chains, finish, graph_modules, replace_chain

aten = torch.ops.aten

ENABLED = True
"""False turns the pass off: the A/B switch of benchmarks (bench/generate.py)."""


def _val(node):
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _only_user(node, users: int = 1):
    return isinstance(node, torch.fx.Node) and len(node.users) == users


def _other(mul, one):
    """The operand of a binary `mul.Tensor` that is not `one`, or None."""
    if mul.target is not aten.mul.Tensor or len(mul.args) != 2 or mul.kwargs:
        return None
    a, b = mul.args
    return b if a is one else a if b is one else None


def _match(rsqrt):
    """(x, weight or None, eps, the node the chain ends at) for the chain around an
    `rsqrt` node, or None (Note [RMS norm as one op])."""
    add = rsqrt.args[0]
    if not _only_user(add) or add.target not in (aten.add.Tensor, aten.add.Scalar):
        return None
    if add.kwargs or len(add.args) != 2 or not isinstance(add.args[1], float | int):
        return None
    mean, eps = add.args
    if not _only_user(mean) or mean.target is not aten.mean.dim:
        return None
    if mean.kwargs.get("dtype") is not None or len(mean.args) < 3 or mean.args[2] is not True:
        return None
    pow_ = mean.args[0]
    if not _only_user(pow_) or pow_.target is not aten.pow.Tensor_Scalar:
        return None
    x32, exponent = pow_.args
    if exponent != 2 or len(rsqrt.users) != 1:
        return None
    scaled = next(iter(rsqrt.users))
    if _other(scaled, rsqrt) is not x32:
        return None
    fake = _val(x32)
    if not isinstance(fake, torch.Tensor) or fake.dim() == 0:
        return None
    if list(mean.args[1]) not in ([-1], [fake.dim() - 1]):
        return None
    x, end = x32, scaled
    if fake.dtype not in (torch.float32, torch.float64):
        return None
    # A half x arrives upcast (x32 = x.to(float32)), and the cast back stands between
    # the norm and the weight: the norm of x32 is fused, the cast and the weight stay.
    weight = None
    if len(end.users) == 1:
        user = next(iter(end.users))
        other = _other(user, end) if user.op == "call_function" else None
        w = _val(other)
        if (isinstance(w, torch.Tensor) and w.dim() == 1 and isinstance(w.shape[0], int)
                and w.shape[0] == fake.shape[-1] and w.dtype == _val(end).dtype):
            weight, end = other, user
    if not isinstance(fake.shape[-1], int):
        return None
    return x, weight, float(eps), end


def fuse_rms_norms(graph_module) -> int:
    """Rewrite every RMS norm chain of `graph_module` (and its subgraphs) as one
    `aten.rms_norm` node; returns how many (Note [RMS norm as one op])."""
    count = 0
    for module in graph_modules(graph_module) if ENABLED else ():
        graph = module.graph
        if not any(n.target is aten.rsqrt.default for n in graph.nodes):
            continue
        # `.to(dtype)` leaves a metadata assertion on its value, which lowering drops
        # anyway (DROPPED_OPS); it would count as a second reader of the chain.
        for node in list(graph.nodes):
            if node.target is aten._assert_tensor_metadata.default and not node.users:
                graph.erase_node(node)
        for x, weight, eps, end in chains(graph, aten.rsqrt.default, _match):
            replace_chain(graph, end, aten.rms_norm.default,
                          (x, [_val(x).shape[-1]], weight, eps), keep=(x, weight))
            count += 1
        finish(module, count)
    return count

