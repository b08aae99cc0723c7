"""The opcode table covers torch's core ATen opset, enumerated from torch itself.

Every overload torch tags `core` (torch.Tag.core: what `run_decompositions()` produces),
and every composite op the frontend keeps whole (KEPT_OPS), either has an opcode, or is
decomposed by the table the frontend exports with (so it never reaches the lowering:
each such op is exported on a sample call and what torch leaves must have opcodes), or
is excluded below for a reason an exported inference graph cannot contain it.
"""

from __future__ import annotations

import pytest
import torch

from dynvm.vm.frontend.export import KEPT_OPS, decomposition_table
from dynvm.vm.opcodes import BY_SOURCE

# Overloads no exported inference graph holds: dynvm lowers `model.eval()` exported
# without gradients, as a pure function of its inputs.
EXCLUDED = {
    "aten._native_batch_norm_legit.default":
        "training-mode batch norm updates running_mean/var in place; in eval mode export "
        "produces _native_batch_norm_legit_no_training (BATCH_NORM)",
    "aten.native_dropout.default":
        "dropout exists only in training graphs: export in eval mode removes it",
}


aten = torch.ops.aten
_X3, _X4, _X5 = (2, 3, 8), (2, 3, 8, 8), (1, 2, 4, 4, 4)
# Core ops the export table decomposes, each with a call on example inputs: the test
# exports it and checks that what torch leaves has opcodes (so "decomposes" is
# established from torch, on this torch, not assumed).
DECOMPOSED_SAMPLES = {
    "aten.adaptive_avg_pool1d.default": (lambda x: aten.adaptive_avg_pool1d(x, [3]), _X3),
    "aten.avg_pool1d.default": (lambda x: aten.avg_pool1d(x, [2], [2], [0], False, True),
                                _X3),
    "aten.col2im.default": (lambda x: aten.col2im(x, [4, 4], [2, 2], [1, 1], [0, 0],
                                                  [2, 2]), (2, 12, 4)),
    "aten.fill.Scalar": (lambda x: aten.fill.Scalar(x, 2.5), _X3),
    "aten.reflection_pad1d.default": (lambda x: aten.reflection_pad1d(x, [1, 2]), _X3),
    "aten.reflection_pad2d.default": (lambda x: aten.reflection_pad2d(x, [1, 2, 2, 1]), _X4),
    "aten.reflection_pad3d.default": (lambda x: aten.reflection_pad3d(x, [1, 1, 2, 1, 1, 2]),
                                      _X5),
    "aten.replication_pad2d.default": (lambda x: aten.replication_pad2d(x, [1, 2, 2, 1]),
                                       _X4),
    "aten.replication_pad3d.default": (lambda x: aten.replication_pad3d(
        x, [1, 1, 2, 1, 1, 2]), _X5),
    "aten.select_scatter.default": (lambda x: aten.select_scatter(x, x[:, 0], 1, 0), _X3),
    "aten.var.dim": (lambda x: aten.var.dim(x, [1], True, False), _X3),
    "aten.sym_is_contiguous.default": (lambda x: x * aten.sym_is_contiguous(x), _X3),
}


class _Calls(torch.nn.Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _excluded_by_rule(overload) -> str | None:
    """A reason shared by a whole class of overloads, read from the schema."""
    if overload._schema.name.endswith("_backward"):
        return "a gradient: an exported inference graph holds no backward pass"
    if any(a.alias_info is not None and a.alias_info.is_write
           for a in overload._schema.arguments):
        return "writes into an argument (an out= or in-place form): export's graphs are " \
               "functional"
    return None


def core_overloads() -> list:
    found = []
    for qualified in torch._C._dispatch_get_all_op_names():
        namespace, _, name = qualified.partition("::")
        if namespace != "aten":
            continue
        base, _, overload_name = name.partition(".")
        packet = getattr(torch.ops.aten, base, None)
        if packet is None:
            continue
        overload = getattr(packet, overload_name or "default", None)
        if overload is not None and torch.Tag.core in overload.tags:
            found.append(overload)
    return sorted(set(found), key=str)


CORE = core_overloads()
DECOMPOSED = decomposition_table()


def test_torch_still_tags_a_core_opset():
    # A torch that stopped tagging would make the coverage test below vacuous.
    assert len(CORE) > 150
    assert torch.ops.aten.convolution.default in CORE


@pytest.mark.parametrize("overload", CORE + list(KEPT_OPS), ids=str)
def test_every_core_op_lowers_or_decomposes(overload):
    if overload in BY_SOURCE:
        assert str(overload) not in EXCLUDED, "has an opcode: drop its exclusion"
        return
    if _excluded_by_rule(overload) or str(overload) in EXCLUDED:
        return
    if overload in DECOMPOSED:
        assert overload not in KEPT_OPS
        assert str(overload) in DECOMPOSED_SAMPLES, \
            f"{overload} is decomposed by the export table: add a sample call to check it"
        return
    pytest.fail(f"{overload} has no opcode, is not decomposed by the export table, and "
                "is not excluded: add an entry to one of dynvm/vm/ops_*.py")


def test_exclusions_are_few_and_still_core():
    assert len(EXCLUDED) <= 5
    names = {str(o) for o in CORE}
    assert set(EXCLUDED) <= names, "an exclusion names an op torch no longer tags core"


def test_kept_ops_are_not_decomposed():
    for kept in KEPT_OPS:
        assert kept not in DECOMPOSED and kept in BY_SOURCE


@pytest.mark.parametrize("name", sorted(DECOMPOSED_SAMPLES))
def test_decomposed_core_ops_leave_only_ops_with_opcodes(name):
    from dynvm.vm.frontend.export import export_module

    fn, shape = DECOMPOSED_SAMPLES[name]
    exported = export_module(_Calls(fn), (torch.randn(*shape),))
    left = {node.target for node in exported.graph.nodes if node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)}
    assert all(str(target) != name for target in left), f"{name} was not decomposed"
    assert all(target in BY_SOURCE for target in left), sorted(map(str, left - set(BY_SOURCE)))
