"""dynvm's panel GEMM (Note [A panel GEMM of our own], jit/backends/cpu/panel_linear.py):
built where a compiler and AVX-512 are, and equal to eager over random shape sequences
in both panel widths: bias or none, each activation, a residual add or none, strided and
offset inputs, row counts on both sides of a register block; and, with
CpuOptions.panel_linear "on", kernels whose linears it runs agree with eager and with
oneDNN's primitives.

Tolerance: the kernel sums K products in order, one FMA a k, where MKL blocks K: on
unit-scale operands fp32 results agree to 1e-4 relative + 2e-5 * sqrt(K) absolute; erf
in the GELU is a polynomial (absolute error below 1.5e-7)."""

from __future__ import annotations

import dataclasses
import random
import sysconfig
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import panel_linear
from dynvm.jit.backends.cpu.panel_linear import PackedPanels
from tests.jit import _jit_helpers as h
from tests.jit._onednn import NEEDS_ONEDNN_LIBRARY

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
    # rows 1..96 cross one register block (16 / 12 rows) into the K-chunked row blocks;
    # K on both sides of a chunk (256) and not a multiple of it; N leaving a partial
    # vector, an odd last 16-column panel (alone past one block) or a partial 32 columns
    rng = random.Random(32)
    torch.manual_seed(32)
    for _ in range(120):
        m = rng.randint(1, 96)
        k = rng.choice([1, 7, 16, 33, 129, 255, 257, 600, 768])
        n = rng.choice([1, 5, 16, 17, 31, 33, 47, 48, 100])
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
def test_threads_calling_at_once_each_equal_eager():
    # past one register block each call packs x's rows into its own scratch first: two
    # threads at once, at row counts past it and within it, each equal to eager
    torch.manual_seed(34)
    weight, bias = torch.randn(70, 300), torch.randn(70)
    packed = PackedPanels(weight)
    inputs = [[torch.randn(m, 300) for m in (20, 40, 9, 90, 30)] for _ in range(2)]
    results: list[list] = [[], []]

    def work(index):
        for _ in range(5):
            results[index] = [panel_linear.panel_linear(x, packed, bias, "relu")
                              for x in inputs[index]]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for xs, got in zip(inputs, results, strict=True):
        for x, y in zip(xs, got, strict=True):
            _close(y, torch.relu(F.linear(x, weight, bias)), 300)


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


class _Block(nn.Module):
    """An encoder layer's GEMMs: QKV, an up projection with erf-GELU, a down projection
    added to its input (the residual add as the binary post-op), a tanh-GELU the panel
    kernel does not compute, and a ReLU head."""

    def __init__(self, d: int = 64, f: int = 256) -> None:
        super().__init__()
        self.qkv, self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(d, f), nn.Linear(f, d)
        self.norm = nn.LayerNorm(d)
        self.tanh_up, self.head = nn.Linear(d, d), nn.Linear(d, 24)

    def forward(self, x):                                         # x: [batch, seq, d]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        y = self.norm(x + q * k + v)
        z = self.down(F.gelu(self.up(y))) + y
        z = z + F.gelu(self.tanh_up(z), approximate="tanh")
        return z, torch.relu(self.head(z))


def _runtime(program, panels: str):
    rt = dynvm.Runtime(program, jit=h.eager_config(cpu_fusion="always"))
    rt.jit._cpu_options = dataclasses.replace(rt.jit._cpu_options, panel_linear=panels)
    return rt


def _block_program():
    torch.manual_seed(0)
    model = _Block().eval()
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=64)
    return model, dynvm.compile(model, (torch.randn(2, 5, 64),), ({0: batch, 1: seq},))


@needs_kernel
@NEEDS_ONEDNN_LIBRARY[0]
@NEEDS_ONEDNN_LIBRARY[1]
def test_kernels_on_panels_agree_with_eager_and_the_primitives(monkeypatch):
    # Exact kernels at PANEL_ROWS put their fp32 linears on the panel GEMM (the weight
    # floor lowered for this small model), others keep oneDNN's primitives; every
    # result as eager's and as the primitives'.
    monkeypatch.setattr(panel_linear, "PANEL_MIN_WEIGHT_BYTES", 0)
    model, program = _block_program()
    gen = torch.Generator().manual_seed(4)
    shapes = [(1, 16), (2, 8), (1, 8), (3, 5), (1, 12), (1, 20), (4, 8), (3, 16), (1, 4),
              (2, 40)]
    with _runtime(program, "on") as rt, _runtime(program, "off") as primitives, \
            torch.no_grad():
        for step, (b, s) in enumerate(shapes):
            x = torch.randn(b + 1, s, 128, generator=gen)[1:, :, ::2]   # offset, strided
            before = x.clone()
            rt(x), primitives(x)        # promoted here (compiled synchronously)
            got, wanted = rt(x), primitives(x)
            for g, w, e in zip(got, wanted, model(x), strict=True):
                torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4, msg=f"step {step}")
                torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4, msg=f"step {step}")
            assert torch.equal(x, before)
        assert not rt.stats()["compile_failures"]
        sources = [a.source for a in rt.jit.artifacts.values()]
        assert not any("panel GEMM" in a.source for a in primitives.jit.artifacts.values())
    # 8-64 rows (1x16, 2x8, 1x8, 3x5, 1x12 in one register block; 1x20, 4x8, 3x16 past
    # it: one exact kernel each): qkv, up + GELU, down + add and the ReLU head on panels,
    # the tanh-GELU linear on its primitive; 4 and 80 rows: none.
    assert sum("4 on dynvm's panel GEMM" in s for s in sources) == 8, sources
    assert sum("panel GEMM" not in s for s in sources) == 2, sources


@needs_kernel
@NEEDS_ONEDNN_LIBRARY[0]
@NEEDS_ONEDNN_LIBRARY[1]
def test_weights_that_fit_a_cores_cache_stay_on_their_primitives():
    _, program = _block_program()
    with _runtime(program, "on") as rt, torch.no_grad():
        x = torch.randn(1, 16, 64)
        rt(x), rt(x)
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources and not any("panel GEMM" in s for s in sources)


@needs_kernel
@NEEDS_ONEDNN_LIBRARY[0]
@NEEDS_ONEDNN_LIBRARY[1]
def test_the_panels_are_asked_onto_huge_pages_once_each(monkeypatch):
    # Note [Packed weights on huge pages]: a kernel's panels are queued for collapse,
    # each packed copy once however many kernels read it
    asked = []
    monkeypatch.setattr(panel_linear, "PANEL_MIN_WEIGHT_BYTES", 0)
    monkeypatch.setattr(panel_linear, "to_huge_pages", asked.append)
    _, program = _block_program()
    with _runtime(program, "on") as rt, torch.no_grad():
        for b, s in ((1, 16), (2, 8), (1, 16)):
            x = torch.randn(b, s, 64)
            rt(x), rt(x)
    panels = {id(t): t for t in asked}
    assert len(panels) == 4, [tuple(t.shape) for t in asked]      # qkv, up, down, head
    assert all(t.dtype == torch.float32 and t.dim() == 3
               and t.shape[-1] == panel_linear.PANEL_WIDTH for t in panels.values())


@needs_kernel
def test_collapsed_panels_compute_the_same():
    from dynvm.jit.backends.cpu import huge_pages
    gen = torch.Generator().manual_seed(9)
    weight = torch.randn(1024, 1024, generator=gen)        # 4 MiB: whole 2 MiB pages
    packed = PackedPanels(weight)
    x = torch.randn(24, 1024, generator=gen)
    before = panel_linear.panel_linear(x, packed)
    huge_pages.to_huge_pages(packed.panels)
    assert huge_pages.drain(timeout=30.0)          # collapsed, or refused by this host
    torch.testing.assert_close(panel_linear.panel_linear(x, packed), before, rtol=0, atol=0)
    _close(before, x @ weight.T, 1024)
