"""dynvm's panel GEMM (Note [A panel GEMM of our own], jit/backends/cpu/panel_linear.py):
built where a compiler and AVX-512 are, and equal to eager over random shape sequences
in both panel widths: bias or none, each activation, a residual add or none, strided and
offset inputs, row counts on both sides of a register block.

Tolerance: the kernel sums K products in order, one FMA a k, where MKL blocks K: on
unit-scale operands fp32 results agree to 1e-4 relative + 2e-5 * sqrt(K) absolute; erf
in the GELU is a polynomial (absolute error below 1.5e-7)."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dynvm.jit.backends.cpu import panel_linear
from dynvm.jit.backends.cpu.panel_linear import PackedPanels

needs_kernel = pytest.mark.skipif(not panel_linear.available(),
                                  reason=panel_linear.unavailable_reason())
EAGER_ACTIVATION = {"none": lambda y: y, "relu": torch.relu, "gelu": F.gelu}


def _cpu_has_avx512() -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512f" in cpuinfo.read_text()


def _close(got, want, k):
    torch.testing.assert_close(got, want, rtol=1e-4, atol=2e-5 * k ** 0.5)


@pytest.mark.skipif(not (_cpu_has_avx512() and sysconfig.get_config_var("CC")),
                    reason="no AVX-512 or no C compiler: the kernel is optional there")
def test_the_kernel_is_built_and_runs_where_it_can():
    assert panel_linear.available(), panel_linear.unavailable_reason()


def test_packing_lays_columns_out_k_major_and_pads_the_last_panel_with_zeros():
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    packed = PackedPanels(weight, width=16)
    assert packed.panels.shape == (2, 3, 16)
    assert packed.panels.data_ptr() % 64 == 0
    assert torch.equal(packed.panels[0], weight[:16].t())
    assert torch.equal(packed.panels[1, :, :4], weight[16:].t())
    assert not packed.panels[1, :, 4:].any()


def test_packing_refuses_what_the_kernel_cannot_read():
    with pytest.raises(TypeError):
        PackedPanels(torch.ones(4, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError):
        PackedPanels(torch.ones(4, 4), width=24)


@needs_kernel
def test_it_equals_eager_over_a_random_shape_sequence():
    rng = random.Random(32)
    torch.manual_seed(32)
    for _ in range(80):
        m = rng.choice([1, 2, 11, 12, 13, 16, 17, 31, 32, 33, 64, 96])
        k = rng.choice([1, 7, 16, 33, 129, 768])
        n = rng.choice([1, 5, 16, 31, 33, 47, 100])
        width = rng.choice([16, 32])
        activation = rng.choice(sorted(EAGER_ACTIVATION))
        weight = torch.randn(n, k)
        bias = torch.randn(n) if rng.random() < 0.7 else None
        base = torch.randn(m + 3, k + 9)
        x = base[2:2 + m, 5:5 + k]                          # strided rows, offset start
        add = torch.randn(m, n + 4)[:, 1:1 + n] if rng.random() < 0.5 else None
        got = panel_linear.panel_linear(x, PackedPanels(weight, width), bias, activation,
                                        add)
        want = EAGER_ACTIVATION[activation](F.linear(x, weight, bias))
        if add is not None:
            want = want + add
        _close(got, want, k)


@needs_kernel
def test_leading_dims_are_kept_and_a_transposed_input_is_copied_first():
    torch.manual_seed(33)
    weight, bias = torch.randn(40, 24), torch.randn(40)
    packed = PackedPanels(weight)
    x = torch.randn(2, 24, 8).transpose(1, 2)               # [2, 8, 24], last dim strided
    got = panel_linear.panel_linear(x, packed, bias, "gelu")
    assert got.shape == (2, 8, 40)
    _close(got, F.gelu(F.linear(x, weight, bias)), 24)
    assert panel_linear.panel_linear(torch.empty(0, 24), packed).shape == (0, 40)


@needs_kernel
def test_bad_operands_are_refused_with_a_reason():
    packed = PackedPanels(torch.randn(8, 4))
    with pytest.raises(ValueError, match="in_features 4"):
        panel_linear.panel_linear(torch.randn(3, 5), packed)
    with pytest.raises(ValueError, match="activations"):
        panel_linear.panel_linear(torch.randn(3, 4), packed, activation="tanh")
    with pytest.raises(TypeError):
        panel_linear.panel_linear(torch.randn(3, 4).double(), packed)
