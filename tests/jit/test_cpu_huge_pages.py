"""Packed weights on huge pages (Note [Packed weights on huge pages]): collapsing a packed
weight's memory changes no result (oneDNN's linear bit for bit, a fused kernel against
eager on contiguous, offset and strided inputs, before and after the collapser thread
ran), a weight is asked once, only the 2 MiB-aligned inside of its memory is asked for,
and the ask returns at once: the collapse is the collapser thread's (Note [Collapsing
after the compile])."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import huge_pages
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.huge_pages import HUGE_PAGE, aligned_span, collapse, drain
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.background import serving
from dynvm.jit.specialize import specialize
from tests.jit._kernel_run import run_kernel_outputs, views

MB = 1 << 20


@pytest.fixture(autouse=True)
def _quick_collapser(monkeypatch):
    # The collapser waits for a quiet queue before it starts; a test needs no compile's
    # worth of quiet.
    monkeypatch.setattr(huge_pages, "QUIET_S", 0.01)


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
    collapsed_before = huge_pages.collapsed_bytes()
    assert huge_pages.to_huge_pages(packed)                # queued, not collapsed here
    assert not huge_pages.to_huge_pages(packed)            # asked once per tensor
    assert drain(timeout=30.0)                             # the collapser thread's turn
    # A kernel or THP setting that refuses leaves 0; where it takes, whole huge pages.
    assert (huge_pages.collapsed_bytes() - collapsed_before) % HUGE_PAGE == 0
    after = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    assert torch.equal(before, after)
    torch.testing.assert_close(after, torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-4, atol=1e-4)
    assert collapse(packed) % HUGE_PAGE == 0               # again, synchronously: the same
    assert torch.equal(before, torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none",
                                                                  [], ""))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_the_collapse_runs_on_the_collapser_thread_not_the_askers(monkeypatch):
    threads = []
    monkeypatch.setattr(huge_pages, "collapse_between_calls",
                        lambda t: threads.append(threading.current_thread().name) or 0)
    weight = torch.ops.mkldnn._reorder_linear_weight(torch.randn(2048, 1024), 1)
    assert huge_pages.to_huge_pages(weight) and drain(timeout=30.0)
    assert threads == ["dynvm-huge-pages"]


def test_a_dense_tensor_and_its_views_keep_their_values():
    base = torch.arange(3 * MB, dtype=torch.float32)
    want = base.clone()
    view = base[5:]                                        # an offset view of it
    huge_pages.to_huge_pages(view)
    huge_pages.to_huge_pages(base)
    assert drain(timeout=30.0)
    assert torch.equal(base, want) and torch.equal(view, want[5:])
    assert collapse(base[5:]) % HUGE_PAGE == 0 and torch.equal(base, want)
    assert not huge_pages.to_huge_pages(torch.empty(0))


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
        assert drain(timeout=30.0)                         # its weight collapsed, or refused
        (again,) = run_kernel_outputs(kernel, region, x)
        with torch.no_grad():
            torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4, msg=kind)
        assert torch.equal(got, again), kind
    assert asked and all(t.is_mkldnn for t in asked)


def _recording_madvise(monkeypatch) -> list:
    """madvise replaced by a recorder of (calls in flight, seconds since the last call
    ended) at each ask: what the collapser saw, whatever this host's THP would do."""
    asks = []

    def madvise(start, length, advice):
        activity = serving()
        asks.append((activity.in_flight, time.monotonic() - activity.last_end, length))
        return 0

    monkeypatch.setattr(huge_pages, "_madvise", lambda: madvise)
    return asks


def test_no_huge_page_is_collapsed_while_a_call_is_in_flight(monkeypatch):
    """Note [Collapsing between calls]: each huge page in a gap between calls."""
    asks = _recording_madvise(monkeypatch)
    monkeypatch.setattr(huge_pages, "GAP_WAIT_S", 30.0)
    tensor = torch.ones(5 * MB // 4)                   # 5 MiB: 1-2 whole huge pages
    pages = aligned_span(*huge_pages._extent(tensor))[1] // HUGE_PAGE
    activity = serving()
    activity.begin()                                  # a call, in flight
    try:
        assert huge_pages.to_huge_pages(tensor)
        time.sleep(0.3)                                # QUIET_S is 0.01 here
        assert asks == []
    finally:
        activity.end()
    assert drain(timeout=30.0)
    assert len(asks) == pages >= 1
    assert all(in_flight == 0 and quiet >= huge_pages.GAP_S for in_flight, quiet, _ in asks)
    assert huge_pages.collapsed_bytes() >= pages * HUGE_PAGE


def test_back_to_back_calls_still_get_their_pages(monkeypatch):
    """With no gap at all, a huge page is taken as a call ends, after GAP_WAIT_S."""
    asks = _recording_madvise(monkeypatch)
    monkeypatch.setattr(huge_pages, "GAP_WAIT_S", 0.02)
    activity, stop = serving(), threading.Event()

    def calls():
        while not stop.is_set():
            activity.begin()
            time.sleep(0.002)
            activity.end()

    caller = threading.Thread(target=calls)
    caller.start()
    try:
        tensor = torch.ones(9 * MB // 4)               # 9 MiB: 3-4 whole huge pages
        pages = aligned_span(*huge_pages._extent(tensor))[1] // HUGE_PAGE
        assert huge_pages.to_huge_pages(tensor)
        assert drain(timeout=30.0)
    finally:
        stop.set()
        caller.join(10)
    assert len(asks) == pages >= 3
