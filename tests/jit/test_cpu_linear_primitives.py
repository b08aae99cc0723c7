"""Linears on oneDNN matmul primitives built once, called through oneDNN's C API (Note
[oneDNN linear primitives built once] in jit/backends/cpu/onednn_linear.py): kernels
use them for the linears fusion put on oneDNN or on dynvm's small-M kernel, and what
they compute equals eager and the interpreter over random shape sequences, offset and
strided inputs, every post-op the pass maps, rows without a primitive (eager's call on
the plain weight), bf16 (within the bf16 chain's tolerance, tests/jit/test_cpu_precision.py)
and with the pass off.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import onednn_api
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.onednn_conv import eltwise_of
from dynvm.jit.backends.cpu.onednn_linear import (
    ANY_ROWS,
    LinearSpec,
    LinearWeights,
    PrimitiveLinear,
)
from dynvm.jit.backends.cpu.precision import precision_available
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.specialize import specialize
from tests.jit import _jit_helpers as h
from tests.jit._onednn import NEEDS_ONEDNN_LIBRARY

pytestmark = NEEDS_ONEDNN_LIBRARY
TOL = {"rtol": 1e-4, "atol": 1e-4}
BF16_RELATIVE = 3e-2        # tests/jit/test_cpu_precision.py's bf16 bound
# oneDNN's bf16 GEMMs: a brgemm on AMX tiles where the CPU has them, else on AVX512-BF16
# (or its gemm:jit at any rows); never a reference one (Note [oneDNN's reference
# implementation refused])
_BF16_BRGEMM = re.compile(r"avx512_core_amx|avx512_core_bf16|gemm:jit:bf16")


class Gemms(nn.Module):
    """Every GEMM form fusion puts on oneDNN, with each epilogue the primitive computes
    as a post-op: linear + GELU into a linear + residual add, MM + ReLU, ADDMM +
    sigmoid, MATMUL + tanh, a linear times a tensor (binary mul), and two linears of one
    input (the specializer makes them one GEMM, no epilogue) whose result leaves the
    region."""

    def __init__(self, d: int = 32, f: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)
        self.norm = nn.LayerNorm(d)
        self.w_mm = nn.Parameter(torch.randn(d, f) / d ** 0.5)
        self.w_add = nn.Parameter(torch.randn(d, f) / d ** 0.5)
        self.b_add = nn.Parameter(torch.randn(f))
        self.w_mat = nn.Parameter(torch.randn(f, d) / f ** 0.5)
        self.gate = nn.Linear(d, d)
        self.twice = nn.Linear(d, d)
        self.head = nn.Linear(d, 8)

    def forward(self, x):                                         # x: [batch, seq, d]
        y = self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))
        flat = y.reshape(-1, y.shape[-1])
        a = torch.relu(flat @ self.w_mm)
        b = torch.sigmoid(torch.addmm(self.b_add, flat, self.w_add))
        c = torch.tanh(torch.matmul(a * b, self.w_mat)).reshape(y.shape)
        g = self.gate(c) * y
        t = self.twice(y)
        return g + t * t, self.head(y)


def _model_and_program():
    torch.manual_seed(0)
    model = Gemms().eval()
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=2, max=64)
    return model, dynvm.compile(model, (torch.randn(2, 5, 32),), ({0: batch, 1: seq},))


def _inputs(gen, steps: int = 8):
    """Random (batch, seq) inputs: contiguous, then offset views, then strided ones."""
    for step in range(steps):
        batch, seq = (int(v) for v in torch.randint(1, 6, (2,), generator=gen))
        seq += 1
        if step % 3 == 0:
            yield torch.randn(batch, seq, 32, generator=gen)
        elif step % 3 == 1:     # offset: a view starting past its storage's first element
            yield torch.randn(batch + 1, seq, 32, generator=gen)[1:]
        else:                   # strided: every other feature of a wider tensor
            yield torch.randn(batch, seq, 64, generator=gen)[..., ::2]


def test_kernels_run_primitives_and_agree_with_eager_and_the_interpreter():
    model, program = _model_and_program()
    config = h.eager_config(cpu_fusion="always")
    gen = torch.Generator().manual_seed(3)
    with dynvm.Runtime(program, jit=config) as rt, \
            dynvm.Runtime(program, jit=None) as interpreter, torch.no_grad():
        for step, x in enumerate(_inputs(gen)):
            before = x.clone()
            rt(x)              # promoted here (compiled synchronously), run next call
            got = rt(x)
            for g, want, ref in zip(got, model(x), interpreter(x)):
                torch.testing.assert_close(g, want, **TOL, msg=f"step {step}")
                torch.testing.assert_close(g, ref, **TOL, msg=f"step {step}")
            assert torch.equal(x, before)      # the caller's tensor is never written
        stats = rt.stats()
        assert stats["specialized_region_calls"] > 0 and not stats["compile_failures"]
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources
    for source in sources:
        # 7 GEMMs, each on a primitive (GELU, ReLU, sigmoid, tanh, the residual add and
        # the gate's mul as post-ops), in both bodies (arena and plain)
        assert source.count("= onednn_linear_primitive") == 14, source
        assert "7 of 7 linear(s) on oneDNN 3." in source, source
        assert "onednn_linear(" not in source and "onednn_linear_binary(" not in source


def test_kernels_with_one_weight_share_one_copy_of_it():
    # Two exact kernels of one engine: each weight is held once, in torch's packed copy
    # read in place where the primitive chose its layout, else in one reordered copy.
    _, program = _model_and_program()
    region = program.regions[0]
    prepacked = PrepackCache()
    constants = [t.detach() for t in program.constants]
    options = CpuOptions(None, fusion="always", prepacked=prepacked)
    kernels = []
    for shape in ((2, 5, 32), (3, 9, 32)):
        spec = specialize(program, region, {region.live_in[0].index: torch.randn(*shape)})
        kernels.append(compile_kernel(spec, program, constants, torch.device("cpu"),
                                      f"k{shape[0]}", "strong", options))
    alive = dict(prepacked._packed.items())
    ours = {k: v for k, v in alive.items() if k[1] == "onednn-linear"}
    assert len(ours) == 7, list(alive)
    for key, weights in ours.items():
        torch_copy = alive.get((key[0], "linear", key[2]))
        assert weights.copies() == 1, key                   # one layout for both M
        if weights.shared():                                # torch's copy, read in place
            assert torch_copy is not None and weights.nbytes() == 0, key
        else:                                               # a copy of its own instead
            assert weights.nbytes() >= weights.plain.numel() * 4, key
    assert sum(w.shared() for w in ours.values()) >= 1
    del kernels, alive, ours, weights, torch_copy
    gc.collect()
    assert prepacked.alive() == 0                           # freed with the kernels


def test_small_m_linears_over_streamed_weights_become_primitives():
    # 2..16 rows over weights streamed from memory went to dynvm's small-M kernel
    # (Note [A small-M GEMM of our own]), the GELU apart; the pass puts them on
    # primitives, the GELU as an eltwise post-op and the residual add as a binary one.
    class Wide(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(1024, 1024), nn.Linear(1024, 1024)

        def forward(self, x):
            return self.b(torch.nn.functional.gelu(self.a(x))) + x

    torch.manual_seed(1)
    model = Wide().eval()
    program = dynvm.compile(model, (torch.randn(2, 1024),), ({0: Dim("m", min=1, max=64)},))
    gen = torch.Generator().manual_seed(5)
    with dynvm.Runtime(program, jit=h.eager_config()) as rt, torch.no_grad():
        for rows in (8, 8, 3, 16):
            x = torch.randn(rows, 1024, generator=gen)
            torch.testing.assert_close(rt(x), model(x), **TOL)
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources and all("dynvm's small-M linear" in s for s in sources)
    assert all(s.count("= onednn_linear_primitive") == 2 for s in sources), sources
    assert all("1 activation(s) or fp32 residual add(s) folded in" in s for s in sources), \
        sources
    assert all("native_linear" not in s.split("def ")[1] and "gelu" not in s.split("def ")[1]
               for s in sources), sources


def _linear(weight, bias, activation, binary, dtype=torch.float32, rows=(5,)):
    library = onednn_api.library()
    eltwise = None if activation is None else eltwise_of(*activation)
    spec = LinearSpec(weight.shape[1], weight.shape[0], dtype, bias is not None, eltwise,
                      binary)
    return PrimitiveLinear(library, spec, LinearWeights(library, weight.to(dtype)), bias,
                           list(rows), activation)


ACTIVATIONS = {
    "relu": (("relu", [], ""), torch.relu),
    "gelu": (("gelu", [], "none"), torch.nn.functional.gelu),
    "gelu_tanh": (("gelu", [], "tanh"),
                  lambda y: torch.nn.functional.gelu(y, approximate="tanh")),
    "swish": (("swish", [], ""), torch.nn.functional.silu),
    "sigmoid": (("sigmoid", [], ""), torch.sigmoid),
    "tanh": (("tanh", [], ""), torch.tanh),
    "leaky_relu": (("leaky_relu", [0.1], ""),
                   lambda y: torch.nn.functional.leaky_relu(y, 0.1)),
    "hardtanh": (("hardtanh", [-0.5, 0.5], ""),
                 lambda y: torch.nn.functional.hardtanh(y, -0.5, 0.5)),
}


@pytest.mark.parametrize("name", list(ACTIVATIONS))
@pytest.mark.parametrize("binary", [None, "add", "mul"])
def test_every_post_op_agrees_with_eager_built_or_not(name, binary):
    gen = torch.Generator().manual_seed(11)
    weight, bias = torch.randn(48, 40, generator=gen), torch.randn(48, generator=gen)
    activation, eager = ACTIVATIONS[name]
    linear = _linear(weight, bias, activation, binary, rows=(6,))
    for rows in (6, 7):       # built; not built: eager's call on the plain weight
        x = torch.randn(rows, 40, generator=gen)
        other = torch.randn(rows, 48, generator=gen) if binary else None
        want = eager(torch.nn.functional.linear(x, weight, bias))
        want = want if binary is None else want + other if binary == "add" else want * other
        torch.testing.assert_close(linear(x, other), want, **TOL, msg=f"{rows} rows")
    assert set(linear.by_rows) == {6}      # nothing built while the call ran


def test_offset_strided_and_batched_inputs_read_as_eager():
    gen = torch.Generator().manual_seed(13)
    weight = torch.randn(24, 16, generator=gen)
    linear = _linear(weight, None, None, "add", rows=(6,))
    wide = torch.randn(4, 3, 40, generator=gen)
    other = torch.randn(2, 3, 24, generator=gen)
    for x in (wide[1:3, :, 8:24],                 # offset rows of a wider tensor
              wide[:2, :, ::2][..., :16],          # strided features
              wide[2:, :, :16].transpose(0, 1).transpose(0, 1)):
        want = torch.nn.functional.linear(x, weight) + other
        torch.testing.assert_close(linear(x, other), want, **TOL)
    torch.testing.assert_close(linear(wide[:2, :, :16], other[:, :, :].clone()),
                               torch.nn.functional.linear(wide[:2, :, :16], weight) + other,
                               **TOL)


@pytest.mark.skipif(precision_available("bf16") is not None,
                    reason=str(precision_available("bf16")))
def test_bf16_kernels_run_bf16_primitives_within_bf16s_tolerance():
    model, program = _model_and_program()
    gen = torch.Generator().manual_seed(17)
    with dynvm.Runtime(program, jit=h.eager_config(cpu_fusion="always",
                                                   precision="bf16")) as rt, torch.no_grad():
        for step, x in enumerate(_inputs(gen, 6)):
            rt(x)
            for got, want in zip(rt(x), model(x)):
                assert got.dtype == torch.float32
                relative = float((got - want).abs().max() / want.abs().max())
                assert relative < BF16_RELATIVE, (step, relative)
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources and all("linear(s) on oneDNN 3." in s and _BF16_BRGEMM.search(s)
                           for s in sources), sources
    assert all(s.count("= onednn_linear_primitive") >= 6 for s in sources), sources
    # the residual add after `down` reads its bf16 result with fp32 x: the primitive
    # writes fp32 with the add as a post-op (no bf16 result, no separate ADD)
    assert all("fp32 residual add(s) folded in" in s for s in sources), sources


def test_a_bf16_primitive_adds_an_fp32_residual_and_writes_fp32():
    gen = torch.Generator().manual_seed(31)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    library = onednn_api.library()
    spec = LinearSpec(24, 40, torch.bfloat16, True, None, "add", torch.float32)
    weights = LinearWeights(library, weight.to(torch.bfloat16))
    for rows in ((7,), (ANY_ROWS,)):
        linear = PrimitiveLinear(library, spec, weights, bias, list(rows), None)
        for m in (7, 3):
            x = torch.randn(m, 24, generator=gen).to(torch.bfloat16)
            residual = torch.randn(m, 40, generator=gen)
            got = linear(x, residual)
            want = torch.nn.functional.linear(x.float(), weight.to(torch.bfloat16).float(),
                                              bias) + residual
            assert got.dtype == torch.float32
            assert float((got - want).abs().max() / want.abs().max()) < 1e-2, (rows, m)


def test_a_bf16_primitive_equals_the_bf16_linear_of_torch():
    gen = torch.Generator().manual_seed(19)
    weight, bias = torch.randn(64, 32, generator=gen), torch.randn(64, generator=gen)
    linear = _linear(weight, bias, ACTIVATIONS["gelu"][0], None, torch.bfloat16, rows=(9,))
    for rows in (9, 4):
        x = torch.randn(rows, 32, generator=gen).to(torch.bfloat16)
        want = torch.nn.functional.gelu(torch.nn.functional.linear(
            x.float(), weight.to(torch.bfloat16).float(), bias))
        got = linear(x, None)
        assert got.dtype == torch.bfloat16
        assert float((got.float() - want).abs().max() / want.abs().max()) < BF16_RELATIVE


@pytest.mark.parametrize("precision", [
    "fp32", pytest.param("bf16", marks=pytest.mark.skipif(
        precision_available("bf16") is not None, reason=str(precision_available("bf16"))))])
def test_families_whose_rows_vary(precision):
    # Rows that vary within a family: bf16 runs one primitive per linear taking its rows
    # with each call (a binary product has no such form and keeps fusion's call); fp32
    # keeps fusion's calls (oneDNN's fp32 at any rows is gemm:jit, slower than torch's).
    model, program = _model_and_program()
    config = h.eager_config(cpu_fusion="always", families=True, precision=precision)
    gen = torch.Generator().manual_seed(23)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for batch, seq in ((2, 5), (3, 7), (2, 6), (4, 5), (3, 6), (2, 7)):
            x = torch.randn(batch, seq, 32, generator=gen)
            for got, want in zip(rt(x), model(x)):
                if precision == "fp32":
                    torch.testing.assert_close(got, want, **TOL)
                else:
                    assert float((got - want).abs().max() / want.abs().max()) < BF16_RELATIVE
        assert rt.stats()["specialized_region_calls"] > 0
        sources = [a.source for a in rt.jit.artifacts.values()]
    family = [s for s in sources if "guard: family" in s]
    assert family, sources
    for source in family:
        if precision == "fp32":
            assert "7 fp32 rows vary in the family" in source, source
            assert "= onednn_linear_primitive" not in source, source
        else:
            assert "linear(s) on oneDNN" in source and _BF16_BRGEMM.search(source), source
            assert "= onednn_linear_primitive" in source, source


def test_a_primitive_for_any_rows_agrees_with_eager():
    gen = torch.Generator().manual_seed(29)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    for activation, binary in ((ACTIVATIONS["gelu"][0], None), (None, "add"), (None, None)):
        linear = _linear(weight, bias, activation, binary, rows=(ANY_ROWS,))
        assert not linear.by_rows
        for rows in (1, 6, 33):
            x = torch.randn(rows, 24, generator=gen)
            other = torch.randn(rows, 40, generator=gen)
            want = torch.nn.functional.linear(x, weight, bias)
            want = torch.nn.functional.gelu(want) if activation else want
            want = want + other if binary else want
            torch.testing.assert_close(linear(x, other if binary else None), want, **TOL)


def test_the_pass_off_leaves_fusions_calls():
    model, program = _model_and_program()
    region = program.regions[0]
    x = torch.randn(2, 5, 32)
    spec = specialize(program, region, {region.live_in[0].index: x})
    options = dataclasses.replace(CpuOptions(None, fusion="always"), linear_primitives="off")
    constants = [t.detach() for t in program.constants]
    kernel = compile_kernel(spec, program, constants, torch.device("cpu"), "off", "strong",
                            options)
    assert "onednn_linear_primitive" not in kernel.source
    assert "= onednn_linear" in kernel.source


# Note [oneDNN's reference implementation refused]: oneDNN limited to AVX-512 without
# BF16 (ONEDNN_MAX_CPU_ISA, read when the library loads: hence a process of its own)
# offers only `ref:any` for a bf16 GEMM with a residual add at any rows, as oneDNN 3.2
# does on AVX512-BF16 CPUs without AMX.
_REFERENCE_REFUSED = """
import torch
from dynvm.jit.backends.cpu import onednn_api as api
from dynvm.jit.backends.cpu.onednn_linear import (ANY_ROWS, LinearSpec, LinearWeights,
                                                   PrimitiveLinear)
from dynvm.jit.backends.cpu.onednn_matmul import LinearPrimitive
library = api.library()
gen = torch.Generator().manual_seed(5)
weight = (torch.randn(64, 32, generator=gen) / 6).to(torch.bfloat16)
bias = torch.randn(64, generator=gen)
spec = LinearSpec(32, 64, torch.bfloat16, True, None, "add", torch.float32)
weights = LinearWeights(library, weight)
try:
    LinearPrimitive(library, spec, ANY_ROWS, weights, bias)
    raise SystemExit("a reference primitive was built")
except api.ReferenceOnly as exc:
    assert "ref" in str(exc), exc
linear = PrimitiveLinear(library, spec, weights, bias, [8, ANY_ROWS], None)
assert set(linear.by_rows) == {8} and linear._any_rows is None, linear.by_rows
assert not any(impl.startswith("ref") for impl in linear.impls()), linear.impls()
for rows in (8, 5, 8, 13):
    x = torch.randn(rows, 32, generator=gen).to(torch.bfloat16)
    other = torch.randn(rows, 64, generator=gen)
    want = torch.nn.functional.linear(x.float(), weight.float(), bias) + other
    got = linear(x, other)
    assert got.dtype == torch.float32 and got.shape == want.shape, (got.dtype, got.shape)
    relative = float((got - want).abs().max() / want.abs().max())
    assert relative < 3e-2, (rows, relative)
print("refused", sorted(linear.impls()))
"""


@pytest.mark.skipif(precision_available("bf16") is not None, reason="no bf16 GEMMs here")
def test_a_reference_implementation_is_refused_and_its_rows_run_eager():
    """Where oneDNN offers only its reference GEMM (here by limiting its ISA in a child
    process), the primitive is refused; a linear keeps its exact rows' primitives and
    runs other rows on eager's linear, equal to eager."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
    child = subprocess.run([sys.executable, "-c", _REFERENCE_REFUSED], capture_output=True,
                           text=True, env=env, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "refused" in child.stdout and "ref" not in child.stdout.split("refused")[1]
