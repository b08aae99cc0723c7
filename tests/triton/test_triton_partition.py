"""Partitioning specialized regions into fusion groups (Note [Fusion groups]): on
hand-built regions whose probes come from real code families, and on the demo
transformer's family specialization."""

from __future__ import annotations

import importlib

import pytest
import torch

from dynvm.jit.backends.triton import TritonOptions, UnsupportedRegion, partition
from dynvm.jit.ir import ConstRef, Literal, SpecializedRegion

th = importlib.import_module("tests.triton._triton_helpers")
op = th.op

ROWS = th.family({0: (6, 32)}, {(0, 0)})         # x [5..16, 32]


def kinds(groups) -> list[tuple[str, list[str]]]:
    return [(g.kind, [o.opcode for o in g.ops]) for g in groups]


def test_elementwise_chain_is_one_group_and_liveness_decides_stores():
    bias = torch.randn(32)
    ops = [op("ADD", 1, 0, ConstRef(0)),          # x + bias (broadcast)
           op("GELU", 2, 1, "tanh"),
           op("MUL", 3, 2, 0.5),                   # %3 is read again by the VIEW
           op("SUB", 4, 3, 1),                     # %4 only by the next op
           op("EXP", 5, 4),                        # %5 a region output
           op("VIEW", 6, 3, Literal([-1]))]
    spec = th.build_region(ops, ROWS, (0,), (5, 6), [bias])
    groups = partition(spec, [bias])
    assert kinds(groups) == [("elementwise", ["ADD", "GELU", "MUL", "SUB", "EXP"]),
                             ("torch", ["VIEW"])]
    assert groups[0].stores == (3, 5)              # %1, %2, %4 stay in registers
    assert groups[1].reasons == ("VIEW has no generated kernel",)


def test_unsupported_broadcasts_dtypes_and_layouts_run_in_torch():
    column = torch.randn(6, 1)                     # broadcast over the last dim
    ops = [op("ADD", 1, 0, ConstRef(0)),
           op("TRANSPOSE", 2, 0, Literal(0), Literal(1)),
           op("RELU", 3, 2),                       # a non-contiguous view
           op("TO_COPY", 4, 0, Literal(torch.float64), Literal(None), Literal(None)),
           op("NEG", 5, 4)]                        # float64
    fam = th.family({0: (6, 32)}, set())           # static: the column has 6 rows
    spec = th.build_region(ops, fam, (0,), (1, 3, 5), [column])
    groups = partition(spec, [column])
    assert [g.kind for g in groups] == ["torch"]
    reasons = dict(zip((o.opcode for o in groups[0].ops), groups[0].reasons))
    assert "broadcast over trailing dims" in reasons["ADD"]
    assert "contiguous=False" in reasons["RELU"]
    assert "torch.float64" in reasons["NEG"]


def test_row_reduction_takes_prologue_and_epilogue():
    weight, bias, shift = torch.randn(32), torch.randn(32), torch.randn(32)
    ops = [op("ADD", 2, 0, ConstRef(2)),                       # x + shift
           op("LAYER_NORM", 3, 2, Literal([32]), ConstRef(0), ConstRef(1), 1e-5,
              Literal(False)),
           op("RELU", 4, 3),
           op("MUL", 5, 4, 2.0),
           op("SOFTMAX", 6, 5, Literal(-1), Literal(None)),   # a second reduction
           op("SOFTMAX", 7, 6, Literal(0), Literal(None))]    # not over the last dim
    spec = th.build_region(ops, ROWS, (0,), (2, 7), [weight, bias, shift])
    groups = partition(spec, [weight, bias, shift])
    assert kinds(groups) == [("row", ["ADD", "LAYER_NORM", "RELU", "MUL"]),
                             ("row", ["SOFTMAX"]), ("torch", ["SOFTMAX"])]
    assert groups[0].anchor == 1 and groups[0].stores == (2, 5)  # %2 is an output
    assert "not over the last dim" in groups[2].reasons[0]


def test_matmul_epilogue_and_vendor_fallback():
    w1, b1, w2 = torch.randn(24, 32), torch.randn(24), torch.randn(24, 24)
    ops = [op("LINEAR", 1, 0, ConstRef(0), ConstRef(1)),   # + GELU + residual: fused
           op("GELU", 2, 1, "none"),
           op("ADD", 3, 2, 1),
           op("LINEAR", 4, 3, ConstRef(2), Literal(None)),  # nothing to fuse: vendor
           op("TRANSPOSE", 5, 4, Literal(0), Literal(1))]
    spec = th.build_region(ops, ROWS, (0,), (4,), [w1, b1, w2])
    groups = partition(spec, [w1, b1, w2])
    assert kinds(groups) == [("matmul", ["LINEAR", "GELU", "ADD"]),
                             ("torch", ["LINEAR", "TRANSPOSE"])]
    assert groups[0].anchor == 0 and groups[0].stores == (3,)
    assert groups[1].reasons[0].startswith("vendor library: LINEAR")
    own = partition(spec, [w1, b1, w2], TritonOptions(vendor_plain_matmul=False))
    assert kinds(own)[:2] == [("matmul", ["LINEAR", "GELU", "ADD"]), ("matmul", ["LINEAR"])]


def test_region_that_rewrites_a_register_is_refused():
    spec = th.build_region([op("NEG", 1, 0), op("EXP", 2, 1)], ROWS, (0,), (2,), [])
    bad = SpecializedRegion(0, (0,), (spec.ops[0], op("EXP", 1, 1)), ((1, spec.outputs[0][1]),),
                            (), True, (), 2, spec.abstract)
    with pytest.raises(UnsupportedRegion, match="%1 is written more than once"):
        partition(bad, [])


def test_demo_transformer_family_region():
    program, spec, fam, _ = th.transformer_family_region()
    assert fam.varying == ((0, 0), (0, 1))
    groups = partition(spec, program.constants)
    fused = [(kind, ops) for kind, ops in kinds(groups) if kind != "torch"]
    assert fused == [("matmul", ["LINEAR", "ADD"]), ("row", ["LAYER_NORM"]),
                     ("matmul", ["LINEAR", "GELU"]), ("matmul", ["LINEAR", "ADD"]),
                     ("row", ["LAYER_NORM"])] * 2
    torch_ops = [o.opcode for g in groups if g.kind == "torch" for o in g.ops]
    assert torch_ops.count("SDPA") == 2 and torch_ops.count("LINEAR") == 2  # qkv: vendor
    # Every value that leaves a group is stored; the region output is among them.
    output = spec.outputs[0][1].reg
    assert output in groups[-1].stores
    for group in groups:
        if group.kind != "torch":
            assert len(group.stores) == 1
