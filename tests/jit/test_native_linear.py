"""dynvm's small-M GEMM (Note [A small-M GEMM of our own], jit/backends/cpu/native_linear.py):
built where a compiler and AVX-512 are, equal to F.linear over random shape sequences in
both weight layouts (bias, residual add, strided and offset views included), and chosen
by the CPU backend for a few rows over streamed weights: the kernel then agrees with the
unfused kernel and with eager, and the engine holds no packed copy of any weight; with
cpu_fusion="dense" (Note [Dense weights only]) no row count packs one.

Tolerance: the kernel sums K products in another order than MKL (vector lanes, then a
lane sum): on unit-scale operands fp32 results agree to 1e-4 relative + 2e-5 * sqrt(K)
absolute (measured worst 3e-5 at K=2048)."""

from __future__ import annotations

import dataclasses
import functools
import random
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import native_linear
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.fusion import is_fused, is_native
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.specialize import specialize
from tests.jit._kernel_run import run_kernel_outputs, views


def _cpu_has_avx512() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512f" in cpuinfo.read_text()


needs_kernel = pytest.mark.skipif(not native_linear.available(),
                                  reason=native_linear.unavailable_reason())


def _close(got, want, k):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * k ** 0.5)


@pytest.mark.skipif(not (_cpu_has_avx512() and sysconfig.get_config_var("CC")),
                    reason="no AVX-512 or no C compiler: the kernel is optional there")
def test_the_kernel_is_built_and_runs_where_it_can():
    # An install that silently left it out would put every few-row GEMM back on oneDNN.
    assert native_linear.available(), native_linear.unavailable_reason()


@needs_kernel
def test_it_equals_linear_over_a_random_shape_sequence():
    rng = random.Random(31)
    torch.manual_seed(31)
    for _ in range(60):
        m, n, k = rng.randint(1, 16), rng.choice([1, 3, 17, 64, 100, 256, 300]), \
            rng.choice([1, 5, 16, 33, 128, 768])
        x, w = torch.randn(m, k), torch.randn(n, k)
        bias = torch.randn(n) if rng.random() < 0.5 else None
        add = torch.randn(m, n) if rng.random() < 0.5 else None
        want = F.linear(x, w, bias) + (0 if add is None else add)
        _close(native_linear.small_m_linear(x, w, bias, add, False), want, k)
        _close(native_linear.small_m_linear(x, w.t().contiguous(), bias, add, True), want, k)


@needs_kernel
@pytest.mark.parametrize("input_major", [False, True], ids=["[N, K]", "[K, N]"])
def test_it_reads_strided_and_offset_views(input_major):
    torch.manual_seed(0)
    w = torch.randn(200, 96)
    stored = w.t().contiguous() if input_major else w
    x = torch.randn(3, 4, 96)
    add = torch.randn(3, 4, 200)
    for name, view in views(x).items():
        big = torch.zeros(3, 9, 203)
        big[:, 1::2, 3:] = add
        got = native_linear.small_m_linear(view, stored, None, big[:, 1::2, 3:], input_major)
        _close(got, F.linear(view, w) + add, 96)
        assert got.shape == (3, 4, 200), name
    # a weight whose rows are not contiguous cannot be read in place
    assert not native_linear.fits(torch.randn(96, 200).t(), False)


class _Step(nn.Module):
    """A decode step's GEMMs at a few rows: an FFN with its residual and a head stored
    input-major ([K, N]) twice, as a MATMUL's constant and (as Note [LM head stored
    input-major] keeps the LM head) as the transposed view a LINEAR reads, 18 MiB of
    weights together, so each GEMM's weight streams (Note [Few rows over a streamed
    weight])."""

    def __init__(self, d: int = 768, f: int = 2048, vocab: int = 1000) -> None:
        super().__init__()
        self.up = nn.Linear(d, f)
        self.down = nn.Linear(f, d, bias=False)
        self.head_t = nn.Parameter(torch.randn(d, vocab) / d ** 0.5)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):                            # x: [batch, seq, d]
        y = x + self.down(F.silu(self.up(x)))         # LINEAR, SILU; LINEAR + ADD
        # MATMUL over a [K, N] constant; LINEAR over the transposed view of one
        return torch.cat([y @ self.head_t, self.head(y)], dim=-1)


@functools.lru_cache(maxsize=1)
def _program():
    model = _Step().eval()
    batch = Dim("batch", min=1, max=64)
    program = dynvm.compile(model, (torch.randn(2, 1, 768),), ({0: batch},))
    # the head's constant stored as dynvm stores an LM head after export:
    # W.t().contiguous().t(), a transposed view of a [K, N] tensor
    head = model.head.weight
    constants = [t.t().contiguous().t() if t.shape == head.shape and torch.equal(t, head)
                 else t for t in program.constants]
    assert any(t.stride() == (1, 1000) for t in constants)
    return model, dataclasses.replace(program, constants=tuple(constants), _cache={})


class _NeverAsked:
    """Every GEMM here is decided without a question; one asked fails the test."""

    rounds, margin = 3, 0.05

    def choose(self, *args, **kwargs):
        raise AssertionError("the calibrator was asked")


def _kernel(program, x, fusion, prepacked):
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: x})
    constants = [t.detach() for t in program.constants]
    options = CpuOptions(None, fusion=fusion, prepacked=prepacked, channels_last="off",
                         one_thread="off", linear_primitives="off",
                         calibrator=_NeverAsked() if fusion in ("measured", "dense") else None)
    return compile_kernel(spec, program, constants, torch.device("cpu"), "test", "strong",
                          options), region


@needs_kernel
@pytest.mark.parametrize("batch", [2, 4, 16])
def test_the_backend_runs_a_few_rows_on_it_without_packed_copies(batch):
    model, program = _program()
    torch.manual_seed(batch)
    x = torch.randn(batch, 1, 768)
    prepacked = PrepackCache()
    kernel, region = _kernel(program, x, "measured", prepacked)
    assert "native_linear" in kernel.source and "small-M" in kernel.source
    assert prepacked.nbytes() == 0    # every weight read where the program keeps it
    plain, _ = _kernel(program, x, "off", PrepackCache())
    assert "native_linear" not in plain.source
    with torch.no_grad():
        for view in views(x).values():
            got = run_kernel_outputs(kernel, region, view)[0]
            _close(got, run_kernel_outputs(plain, region, view)[0], 2048)
            _close(got, model(view), 2048)


@needs_kernel
def test_the_residual_add_is_folded_in_and_the_activation_is_not():
    _, program = _program()
    region = program.regions[0]
    x = torch.randn(4, 1, 768)
    spec = specialize(program, region, {region.live_in[0].index: x})
    kernel, _ = _kernel(program, x, "measured", PrepackCache())
    native = [line for line in kernel.source.splitlines() if "= native_linear" in line]
    assert len(native) == 4                  # up, down (+ the residual), the two heads
    # both heads read input-major, the LINEAR's through the tensor under its view
    assert [line.rstrip(")").endswith("True") for line in native] == [False, False, True, True]
    residuals = [line.split("(", 1)[1].split(", ")[3] for line in native]
    assert sum(r != "None" for r in residuals) == 1   # the down projection's add
    assert "silu" in kernel.source.lower()   # the activation stays an op of its own
    assert not any(is_fused(op) or is_native(op) for op in spec.ops)   # IR untouched


@pytest.mark.parametrize("batch", [1, 4, 32], ids=["a GEMV", "a few rows", "a prompt's rows"])
def test_dense_fusion_packs_no_weight_at_any_row_count(batch):
    model, program = _program()
    x = torch.randn(batch, 1, 768)
    prepacked = PrepackCache()
    kernel, region = _kernel(program, x, "dense", prepacked)   # asks no question
    assert prepacked.nbytes() == 0 and "onednn" not in kernel.source
    # one row: the [N, K] weights only (over an input-major head MKL's GEMV is as fast)
    calls = kernel.source.count("= native_linear")
    assert calls == (0 if not native_linear.available() else 2 if batch == 1
                     else 4 if batch <= 16 else 0)
    with torch.no_grad():
        _close(run_kernel_outputs(kernel, region, x)[0], model(x), 2048)


def test_jit_config_takes_dense_fusion():
    from dynvm.jit.config import ConfigError, JitConfig

    assert JitConfig(cpu_fusion="dense").cpu_fusion == "dense"
    with pytest.raises(ConfigError, match="'dense'"):
        JitConfig(cpu_fusion="packed")


@needs_kernel
def test_a_strided_bias_constant_is_given_to_the_kernel_as_one_row():
    model, program = _program()
    bias = model.up.bias.detach()
    spread = torch.zeros(2 * bias.numel())
    spread[::2] = bias
    constants = [spread[::2] if t.shape == bias.shape and torch.equal(t, bias) else t
                 for t in program.constants]
    assert any(not t.is_contiguous() for t in constants if t.dim() == 1)
    program = dataclasses.replace(program, constants=tuple(constants), _cache={})
    x = torch.randn(4, 1, 768)
    kernel, region = _kernel(program, x, "measured", PrepackCache())
    assert kernel.source.count("= native_linear") == 4
    with torch.no_grad():
        _close(run_kernel_outputs(kernel, region, x)[0], model(x), 2048)
