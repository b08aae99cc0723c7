"""GEMMs in bf16 and int8 on the CPU backend (Note [Lower-precision GEMMs]): which ops
the pass rewrites and where it casts, that the kernels stay within a stated distance of
the fp32 interpreter (strided and offset views included), that guards and code
families still serve random shape sequences, and that the option is part of the cache
key and validated.

Tolerance, measured on these unit-scale inputs (K <= 64): bf16 rounds each GEMM's
inputs and weight to 8 bits of mantissa, so outputs move by well under 1% of their
scale (worst 0.74% over 5 shapes x 3 seeds x 3 views; bert-base width 0.33%, Note
[Precision accuracy] in bench/precision_accuracy.py); int8 (per-channel weights,
per-tensor activations) by about twice that (worst 1.5% here; bert-base width 1.5%).
The tests hold the largest |out - fp32| to 3% (bf16) and 6% (int8) of the largest
|fp32|: four times the measured worst, and far below what a wrong cast, transpose,
bias or epilogue gives (O(1)).
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.precision import precision_available
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.specialize import specialize
from dynvm.vm.errors import ConfigError
from tests.jit._kernel_run import run_kernel_outputs, views

RELATIVE = {"bf16": 3e-2, "int8-dynamic": 6e-2}
PRECISIONS = [pytest.param(p, marks=pytest.mark.skipif(
    precision_available(p) is not None, reason=str(precision_available(p))))
    for p in RELATIVE]


class Gemms(nn.Module):
    """Every GEMM form the pass lowers and every way its result is read: a bf16 chain
    (linear + GELU into a linear), a residual add (fp32 by promotion), MM/MATMUL/ADDMM
    with epilogues, a result used twice and a GEMM result leaving the region."""

    def __init__(self, d: int = 32, f: int = 64) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, f), nn.Linear(f, d)
        self.norm = nn.LayerNorm(d)
        self.w_mm = nn.Parameter(torch.randn(d, f) / d ** 0.5)
        self.w_add = nn.Parameter(torch.randn(d, f) / d ** 0.5)
        self.b_add = nn.Parameter(torch.randn(f))
        self.w_mat = nn.Parameter(torch.randn(f, d) / f ** 0.5)
        self.twice = nn.Linear(d, d)
        self.head = nn.Linear(d, 8)

    def forward(self, x):                                         # x: [batch, seq, d]
        y = self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))
        flat = y.reshape(-1, y.shape[-1])
        a = torch.relu(flat @ self.w_mm)
        b = torch.sigmoid(torch.addmm(self.b_add, flat, self.w_add))
        c = torch.tanh(torch.matmul(a * b, self.w_mat)).reshape(y.shape)
        t = self.twice(y)
        return c + t * t, self.head(y)


@functools.lru_cache(maxsize=1)
def _program():
    torch.manual_seed(0)
    model = Gemms().eval()
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=2, max=64)
    return model, dynvm.compile(model, (torch.randn(2, 5, 32),), ({0: batch, 1: seq},))


def _relative(actual, expected) -> float:
    return max(float((a - e).abs().max() / e.abs().max()) for a, e in zip(actual, expected))


def _kernel(program, x, precision, prepacked=None):
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: x})
    options = CpuOptions(None, fusion="always", precision=precision,
                         prepacked=prepacked or PrepackCache(), linear_primitives="off")
    constants = [t.detach() for t in program.constants]
    return compile_kernel(spec, program, constants, torch.device("cpu"), "test", "strong",
                          options), region



def test_bf16_casts_once_per_value_and_keeps_bf16_between_gemms():
    if precision_available("bf16") is not None:
        pytest.skip(precision_available("bf16"))
    _, program = _program()
    kernel, _ = _kernel(program, torch.randn(3, 7, 32), "bf16")
    notes = "\n".join(kernel.notes)
    # seven GEMMs in the model; `twice` and `head` read one value, so the frontend made
    # them one (Note [Parallel linears as one]): six in the kernel
    assert notes.count("-> oneDNN bf16 linear") == 6, notes
    # linear + GELU feeds the next linear in bf16; that one's result meets the residual
    # add, which promotes to fp32 with no cast
    assert "LINEAR + GELU (pc" in notes and "reads its bf16 input, result kept bf16" in notes
    # MM and ADDMM read one value: one cast serves both; a layer norm's result is cast
    # by the norm itself (Note [Layer norm writing bf16 too])
    assert kernel.source.count("= to_bf16") + kernel.source.count("= layer_norm_bf16") \
        == notes.count("input cast to bf16")
    assert notes.count("input cast to bf16") == 4, notes
    # the linear used twice and the head (a region output) cast back
    assert notes.count("result cast to fp32") >= 2
    assert "to_fp32" in kernel.source and "onednn_linear" in kernel.source


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("shape", [(1, 2), (16, 33)])
def test_kernel_within_tolerance_of_fp32_onviews(precision, shape):
    model, program = _program()
    gen = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    base = torch.randn(*shape, 32, generator=gen)
    with torch.no_grad():
        want = model(base)
    for kind, x in views(base).items():
        kernel, region = _kernel(program, x, precision)
        got = run_kernel_outputs(kernel, region, x)
        assert [g.dtype for g in got] == [torch.float32] * 2
        assert [g.shape for g in got] == [w.shape for w in want]
        assert _relative(got, want) <= RELATIVE[precision], (kind, shape)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_families_and_guards_serve_random_shapes(precision):
    """Random shapes through a Runtime with families on: every call agrees with the fp32
    interpreter within the tolerance, and kernels really ran."""
    _, program = _program()
    config = dynvm.JitConfig(sync=True, min_recurrence=1, max_recurrence=2,
                             expected_speedup=1.0, instructions_per_recurrence_step=10**6,
                             horizon_calls=10**9, families=True, probation=False,
                             precision=precision)
    jit, interp = dynvm.Runtime(program, jit=config), dynvm.Runtime(program, jit=False)
    rng = random.Random(7)
    shapes = [(rng.randint(1, 9), rng.randint(2, 40)) for _ in range(10)]
    kinds = [rng.choice(["contiguous", "contiguous", "offset", "strided"]) for _ in shapes]
    try:
        for _ in range(2):   # the second pass: every shape has a kernel by now
            for shape, kind in zip(shapes, kinds):
                x = views(torch.randn(*shape, 32))[kind]
                assert _relative(jit(x), interp(x)) <= RELATIVE[precision]
        stats = jit.stats()
        assert stats["specialized_region_calls"] >= 10 and stats["family_compiles"] >= 1
        assert stats["specialize_failures_total"] == 0 and stats["deopts"] == 0
    finally:
        jit.close()
        interp.close()


def test_packed_low_precision_weights_are_shared_between_kernels():
    if precision_available("bf16") is not None:
        pytest.skip(precision_available("bf16"))
    _, program = _program()
    cache = PrepackCache()
    first, _ = _kernel(program, torch.randn(2, 5, 32), "bf16", cache)
    packs = cache.packs
    second, _ = _kernel(program, torch.randn(4, 9, 32), "bf16", cache)
    assert packs == 6 and cache.packs == packs and first and second  # twice + head: one


def test_precision_is_validated_and_part_of_the_key():
    with pytest.raises(ConfigError, match="precision"):
        dynvm.JitConfig(precision="fp16")
    assert dynvm.JitConfig().precision == "fp32"
    assert "precision" not in CpuOptions().as_key()       # fp32 keys unchanged
    assert CpuOptions(precision="bf16").as_key() != CpuOptions(precision="int8-dynamic").as_key()
