"""Decompose an exported graph without torch.export's retrace, where that is exact.

Note [Decomposing without a retrace]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
`ExportedProgram.run_decompositions` traces the whole graph a second time (AOT
functionalization over fake tensors and symbolic sizes): on the demo Transformer it is
0.9-1.1 s of `dynvm.compile`'s 2 s, as long as torch.export's own trace, while dynvm's
lowering and verification take 5 ms. Most graphs need that retrace: torch.export's
training IR still holds in-place ops, dropout, `to`, `conv2d` and other composite ops
that only the retrace turns into functional core ATen (every zoo model does). Some
graphs are already what the retrace would give back, up to a few ops whose
decomposition is a one-for-one rename; for those the retrace is skipped:

- an op the retrace leaves alone: not mutable, not in the decomposition table, and
  either no CompositeImplicitAutograd kernel or one of the kept ops (Note [Kept ops])
  with a functional schema (torch preserves only those); size queries and arithmetic,
  `getitem`, the dropped assertions, and `cond` / `while_loop` whose subgraphs pass the
  same test;
- `transpose.int` -> `permute` with the two dims swapped (torch's decomposition,
  canonicalized dims; rank <= 1 or equal dims alias, and are left to the retrace);
- `reshape` -> `view` with the same sizes, when the reshape's result already aliases its
  input in the exported graph's fake values (torch chose a view, which is what its
  decomposition emits); a reshape that copied becomes clone + view there, and is left
  to the retrace.

Anything else sends the whole graph through `run_decompositions` as before, and the
graph is only changed once every node is known to pass, so a fallback sees it untouched.
tests/vm/test_frontend_decompose.py checks, on every demo model and on graphs that must
fall back, that both paths give programs with equal content hashes and code listings.
"""

from __future__ import annotations

import functools
import operator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from dynvm.vm.frontend.kept_ops import KEPT_OPS, decomposition_table
from dynvm.vm.frontend.lower import DROPPED_OPS
from dynvm.vm.opcodes import BY_SOURCE

aten = torch.ops.aten

_CONTROL_FLOW = (torch.ops.higher_order.cond, torch.ops.higher_order.while_loop)
# Size queries are in the decomposition table, but the retrace emits them again where a
# size is read, as the export's own trace did.
_SIZE_QUERIES = frozenset({aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
                           aten.sym_storage_offset.default})


@functools.cache
def _decomposed_ops() -> frozenset:
    return frozenset(decomposition_table().materialize())


@functools.cache
def _left_alone(op: torch._ops.OpOverload) -> bool:
    """True if run_decompositions keeps `op` as it is (Note [Decomposing without a
    retrace])."""
    schema = op._schema
    if schema.is_mutable or op in _decomposed_ops():
        return False
    composite = torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), torch._C.DispatchKey.CompositeImplicitAutograd)
    if not composite:
        return True
    aliasing = any(a.alias_info is not None for a in (*schema.arguments, *schema.returns))
    return op in KEPT_OPS and not aliasing


def _fake(value):
    return value.meta.get("val") if isinstance(value, torch.fx.Node) else None


def _as_permute(node):
    """`transpose.int` as torch's decomposition writes it, or None."""
    source, dim0, dim1 = node.args
    fake = _fake(source)
    if not isinstance(fake, torch.Tensor) or fake.ndim <= 1 or dim0 == dim1:
        return None
    first, second = (d % fake.ndim for d in (dim0, dim1))
    permutation = list(range(fake.ndim))
    permutation[first], permutation[second] = second, first
    return aten.permute.default, (source, permutation)


def _as_view(node):
    """`reshape` that torch resolved to a view, as `view`, or None."""
    source, sizes = node.args
    before, after = _fake(source), node.meta.get("val")
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)):
        return None
    if StorageWeakRef(before.untyped_storage()) != StorageWeakRef(after.untyped_storage()):
        return None
    return aten.view.default, (source, sizes)


_RENAMES = {aten.transpose.int: _as_permute, aten.reshape.default: _as_view}


def _kept_as_is(target) -> bool:
    if isinstance(target, torch._ops.OpOverload):
        return target in DROPPED_OPS or target in _SIZE_QUERIES or _left_alone(target)
    return target is operator.getitem or target in _CONTROL_FLOW or target in BY_SOURCE


def decompose_in_place(exported) -> bool:
    """Rewrite `exported`'s graphs to what run_decompositions would give and return
    True, or leave them untouched and return False when only the retrace can
    (Note [Decomposing without a retrace])."""
    renames = []
    for module in exported.graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op in ("placeholder", "output", "get_attr"):
                continue
            if node.op != "call_function" or node.kwargs:
                return False
            if _kept_as_is(node.target):
                continue
            rename = _RENAMES.get(node.target)
            renamed = rename(node) if rename is not None else None
            if renamed is None:
                return False
            renames.append((node, renamed))
    for node, (target, args) in renames:
        node.target, node.args = target, args
    return True
