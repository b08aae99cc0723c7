"""Packed weights on huge pages (Note [Packed weights on huge pages]): collapsing a packed
weight's memory changes no result (oneDNN's linear bit for bit, a fused kernel against
eager on contiguous, offset and strided inputs), a weight is asked once, and only the
2 MiB-aligned inside of its memory is asked for."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import huge_pages
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.huge_pages import HUGE_PAGE, aligned_span, to_huge_pages
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.specialize import specialize
from tests.jit._kernel_run import run_kernel_outputs, views

MB = 1 << 20


def test_only_the_aligned_inside_is_asked():
    assert aligned_span(0, 4 * MB) == (0, 4 * MB)
    assert aligned_span(64, 4 * MB) == (HUGE_PAGE, HUGE_PAGE)
    assert aligned_span(HUGE_PAGE + 64, 3 * MB) == (2 * HUGE_PAGE, 0)   # none fits
    assert aligned_span(HUGE_PAGE - 1, HUGE_PAGE + 1) == (HUGE_PAGE, HUGE_PAGE)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_a_packed_weight_computes_the_same_after_collapse_and_is_asked_once():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(2048, 1024, generator=gen)        # 8 MiB packed: >= 3 huge pages
    x, bias = torch.randn(16, 1024, generator=gen), torch.randn(2048, generator=gen)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 16)
    before = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    collapsed = to_huge_pages(packed)
    # A kernel or THP setting that refuses leaves 0; where it takes, whole huge pages.
    assert collapsed % HUGE_PAGE == 0
    assert to_huge_pages(packed) == 0                      # asked once per tensor
    after = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    assert torch.equal(before, after)
    torch.testing.assert_close(after, torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-4, atol=1e-4)


def test_a_dense_tensor_and_its_views_keep_their_values():
    base = torch.arange(3 * MB, dtype=torch.float32)
    want = base.clone()
    to_huge_pages(base[5:])                                # an offset view of it
    to_huge_pages(base)
    assert torch.equal(base, want)
    assert to_huge_pages(torch.empty(0)) == 0


class Wide(nn.Module):
    """A linear wide enough that its packed weight holds whole huge pages, with GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(512, 4096)

    def forward(self, x):
        return torch.nn.functional.gelu(self.up(x))


def test_a_fused_kernel_with_collapsed_weights_agrees_with_eager_on_views(monkeypatch):
    asked = []
    monkeypatch.setattr("dynvm.jit.backends.cpu.fusion.to_huge_pages",
                        lambda t: asked.append(t) or huge_pages.to_huge_pages(t))
    model = Wide().eval()
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=16)
    program = dynvm.compile(model, (torch.randn(2, 5, 512),), ({0: batch, 1: seq},))
    region = program.regions[0]
    constants = [t.detach() for t in program.constants]
    base = torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(1))
    for kind, x in views(base).items():
        spec = specialize(program, region, {region.live_in[0].index: x})
        options = CpuOptions(None, fusion="always", channels_last="off",
                             prepacked=PrepackCache(), one_thread="off")
        kernel = compile_kernel(spec, program, constants, torch.device("cpu"), "test",
                                "strong", options)
        assert "onednn" in kernel.source, kernel.source
        (got,) = run_kernel_outputs(kernel, region, x)
        with torch.no_grad():
            torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4, msg=kind)
    assert asked and all(t.is_mkldnn for t in asked)
