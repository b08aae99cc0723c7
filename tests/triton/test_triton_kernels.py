"""Generated Triton kernels against eager PyTorch, run by Triton's interpreter on CPU
tensors (TRITON_INTERPRET=1, set in conftest.py): every kernel kind (elementwise chain,
softmax, layer norm, matmul with epilogue), each on two code families, each compiled
once per family and run for several members with different varying dims."""

from __future__ import annotations

import importlib
import random

import pytest
import torch

from dynvm.jit.backends.triton import LaunchError, TritonOptions, generate_region
from dynvm.jit.backends.triton.run_interpreted import InterpretedRegion
from dynvm.jit.ir import ConstRef, Literal

pytestmark = pytest.mark.interpreted   # kernels run in Triton's interpreter (conftest.py)

th = importlib.import_module("tests.triton._triton_helpers")
op = th.op

C0, C1, C2 = ConstRef(0), ConstRef(1), ConstRef(2)
ROWS_2D = th.family({0: (6, 32)}, {(0, 0)})            # [5..16, 32]
BATCH_SEQ = th.family({0: (2, 8, 24)}, {(0, 0), (0, 1)})  # [2..4, 5..16, 24]


def elementwise_case(fam, width):
    """Every required elementwise op in one chain; %5 is stored as a second output."""
    constants = [torch.randn(width), torch.rand(width) + 0.5]
    ops = [op("ADD", 1, 0, C0), op("GELU", 2, 1, "none"), op("MUL", 3, 2, 0),
           op("SUB", 4, 3, 0.25), op("TANH", 5, 4), op("SILU", 6, 5), op("SIGMOID", 7, 6),
           op("NEG", 8, 7), op("EXP", 9, 8), op("DIV", 10, 9, C1), op("SUB", 11, 10, 0.7),
           op("RELU", 12, 11), op("ADD", 13, 12, 0), op("GELU", 14, 13, "tanh")]
    return fam, ops, (5, 14), constants, [("elementwise", 14)]


def elementwise_extras_case():
    """The other elementwise ops the backend generates (beyond the required set)."""
    ops = [op("ABS", 1, 0), op("ADD", 2, 1, 0.5), op("SQRT", 3, 2), op("RSQRT", 4, 3),
           op("LOG", 5, 4), op("ERF", 6, 5), op("ADD", 7, 6, 2.0), op("RECIPROCAL", 8, 7)]
    return ROWS_2D, ops, (8,), [], [("elementwise", 8)]


def softmax_case_rows():
    constants = [torch.randn(40), torch.randn(40)]
    fam = th.family({0: (6, 40)}, {(0, 0)})
    ops = [op("MUL", 1, 0, 0.125), op("ADD", 2, 1, C0),
           op("SOFTMAX", 3, 2, Literal(-1), Literal(None)), op("MUL", 4, 3, C1)]
    return fam, ops, (4,), constants, [("row", 4)]


def softmax_case_varying_rows():
    """Softmax over a last dim that varies in the family: the row length is a runtime
    argument and BLOCK_N covers the family's longest row."""
    fam = th.family({0: (4, 8, 8)}, {(0, 1), (0, 2)})
    ops = [op("DIV", 1, 0, 3.0), op("SOFTMAX_", 2, 1, Literal(-1), Literal(False)),
           op("SUB", 3, 2, 0.01)]
    return fam, ops, (3,), [], [("row", 3)]


def layer_norm_case_affine():
    constants = [torch.randn(48), torch.randn(48)]
    fam = th.family({0: (2, 8, 48)}, {(0, 0), (0, 1)})
    ops = [op("MUL", 1, 0, 2.0), op("ADD", 2, 1, 0),
           op("LAYER_NORM", 3, 2, Literal([48]), C0, C1, 1e-5, Literal(False)),
           op("GELU", 4, 3, "tanh")]
    return fam, ops, (2, 4), constants, [("row", 4)]


def layer_norm_case_plain():
    constants = [torch.randn(64)]
    fam = th.family({0: (6, 64)}, {(0, 0)})
    ops = [op("LAYER_NORM", 1, 0, Literal([64]), Literal(None), Literal(None), 1e-6,
              Literal(False)),
           op("ADD", 2, 1, C0)]
    return fam, ops, (2,), constants, [("row", 2)]


def matmul_case_linear():
    constants = [torch.randn(32, 32) / 6, torch.randn(32)]
    fam = th.family({0: (2, 8, 32)}, {(0, 0), (0, 1)})
    ops = [op("LINEAR", 1, 0, C0, C1), op("GELU", 2, 1, "none"), op("ADD", 3, 2, 0)]
    return fam, ops, (3,), constants, [("matmul", 3)]


def matmul_case_mm():
    """MM + ReLU, ADDMM + SiLU, and a plain LINEAR (its own kernel with the vendor
    fallback off); K=40 and N=24 are not multiples of the tiles."""
    constants = [torch.randn(40, 24) / 6, torch.randn(24), torch.randn(16, 40) / 6]
    fam = th.family({0: (6, 40)}, {(0, 0)})
    ops = [op("MM", 1, 0, C0), op("RELU", 2, 1),
           op("ADDMM", 3, C1, 0, C0), op("SILU", 4, 3),
           op("LINEAR", 5, 0, C2, Literal(None))]
    return fam, ops, (2, 4, 5), constants, [("matmul", 2), ("matmul", 2), ("matmul", 1)]


CASES = {
    "elementwise-rows": lambda: elementwise_case(ROWS_2D, 32),
    "elementwise-batch-seq": lambda: elementwise_case(BATCH_SEQ, 24),
    "elementwise-extras": elementwise_extras_case,
    "softmax-rows": softmax_case_rows,
    "softmax-varying-row-length": softmax_case_varying_rows,
    "layer-norm-affine": layer_norm_case_affine,
    "layer-norm-plain": layer_norm_case_plain,
    "matmul-linear-epilogue": matmul_case_linear,
    "matmul-mm-addmm": matmul_case_mm,
}
OPTIONS = TritonOptions(vendor_plain_matmul=False)


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_eager_across_the_family(case):
    fam, ops, outputs, constants, expected = CASES[case]()
    spec = th.build_region(ops, fam, (0,), outputs, constants)
    code = generate_region(spec, constants, OPTIONS)
    assert [(g.kind, len(g.ops)) for g in code.groups] == expected
    # Varying dims are runtime ints (or only size the grid), the others constexprs: one
    # kernel serves the family.
    for launch, kernel in zip(code.plan.kernels(), code.kernels):
        runtime = {d.name for d in launch.dims if d.in_kernel and d.static is None}
        assert runtime == {name for name, kind in kernel.signature.items() if kind == "i32"}
        static = {d.name for d in launch.dims if d.in_kernel and d.static is not None}
        assert static <= set(kernel.constexprs)
        assert any(d.static is None for d in launch.dims), \
            f"{kernel.name}: nothing varies in a family with varying dims"
    runner = InterpretedRegion(code.plan, code.kernels, constants)
    rng = random.Random(case)
    members = th.member_dims(fam, rng, 3)
    for dims in members:
        x = torch.randn(dims[0], generator=torch.Generator().manual_seed(rng.getrandbits(31)))
        got = th.run_region(runner, spec, {0: x})
        want = th.eager(spec, {0: x}, constants)
        for reg in outputs:
            torch.testing.assert_close(got[reg], want[reg], rtol=1e-4, atol=1e-5,
                                       msg=lambda m, d=dims, r=reg: f"{case} {d} %{r}: {m}")
    assert runner.launches == len(code.plan.kernels()) * len(members)


def test_varying_row_length_is_a_runtime_argument():
    fam, ops, outputs, constants, _ = softmax_case_varying_rows()
    code = generate_region(th.build_region(ops, fam, (0,), outputs, constants), constants)
    (kernel,) = code.kernels
    assert kernel.signature["N"] == "i32" and kernel.constexprs == {"BLOCK_N": 16}
    assert "ROWS" not in kernel.signature            # only the grid needs it


def test_a_static_dim_that_differs_is_refused_per_call():
    fam, ops, outputs, constants, _ = softmax_case_rows()
    spec = th.build_region(ops, fam, (0,), outputs, constants)
    code = generate_region(spec, constants)
    runner = InterpretedRegion(code.plan, code.kernels, constants)
    regs = [torch.randn(6, 41), None, None, None, None]
    with pytest.raises(LaunchError, match="dim N is 41, the kernel was compiled for 40"):
        runner(regs)
    assert regs[4] is None                           # the register file is untouched


def test_demo_transformer_family_matches_the_module():
    program, spec, fam, module = th.transformer_family_region()
    code = generate_region(spec, program.constants)
    # 10 launches, 4 kernels: both layers, and both residual adds of a width, share them.
    assert (len(code.plan.kernels()), len(code.kernels)) == (10, 4)
    runner = InterpretedRegion(code.plan, code.kernels, program.constants)
    rng = random.Random(7)
    output = spec.outputs[0][0]
    for dims in th.member_dims(fam, rng, 3):
        x = torch.randn(dims[0])
        got = th.run_region(runner, spec, {0: x})[output]
        with torch.inference_mode():
            want = module(x)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
