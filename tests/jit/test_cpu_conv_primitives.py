"""Channels-last fused convolutions on oneDNN primitives built once, called through
oneDNN's C API (Note [oneDNN primitives built once] in jit/backends/cpu/onednn_conv.py):
the library loads wherever dynvm's `onednn` extra is installed (a test fails when it is
installed and the path is silently off), kernels use it, and what they compute equals
eager: random batches of a family, offset and strided inputs, residual adds written in
place, every activation the pass maps to an eltwise post-op, strides, padding and
dilation.

Tolerance as tests/jit/test_cpu_conv.py's (batch norm folded into the weight rounds
differently from normalizing the output).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import chain_library, onednn_api
from dynvm.jit.backends.cpu.conv_residual import CONV_BINARY_INPLACE
from dynvm.jit.backends.cpu.fusion import onednn_available
from dynvm.jit.backends.cpu.onednn_conv import (
    ConvSpec,
    PrimitiveConv,
    eltwise_of,
    torch_fallback,
)
from dynvm.jit.ir import Literal, SpecOp, Var
from tests.jit import _jit_helpers as h

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                                reason="this torch build has no oneDNN")
TOL = {"rtol": 1e-4, "atol": 1e-4}
_mkldnn = torch.ops.mkldnn
needs_library = pytest.mark.skipif(
    onednn_api.library() is None,
    reason=f"oneDNN's C library is not loaded: {onednn_api.unavailable_reason()}")


@pytest.fixture(autouse=True)
def _primitives_one_by_one(monkeypatch):
    """These tests read each primitive op in a kernel's source: the chain library is
    taken away, as where it was not built (Note [A chain of primitives in one call];
    tests/jit/test_cpu_chain_native.py covers the chains)."""
    monkeypatch.setattr(chain_library, "_find_library", lambda: None)


def test_the_library_loads_where_the_extra_is_installed():
    # A silently missing library would put every convolution back on torch's calls.
    if not onednn_api.installed():
        pytest.skip(f"{onednn_api.DISTRIBUTION} is not installed (dynvm's `onednn` extra)")
    library = onednn_api.library()
    assert library is not None, onednn_api.unavailable_reason()
    assert library.version.startswith("3.")
    # one OpenMP runtime in the process: libdnnl runs on torch's team
    runtimes = onednn_api._openmp_runtimes()
    assert len(runtimes) <= 1, runtimes


class _Bottlenecks(nn.Module):
    """ResNet's bottleneck twice: the first with a strided 3x3 and a downsampling 1x1
    (its fused result is the residual, written in place), the second adding the first's
    output (itself a result written in place)."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem, self.b0 = nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.a1, self.ab1 = nn.Conv2d(c, c // 2, 1, bias=False), nn.BatchNorm2d(c // 2)
        self.a2, self.ab2 = nn.Conv2d(c // 2, c // 2, 3, 2, 1, bias=False), nn.BatchNorm2d(c // 2)
        self.a3, self.ab3 = nn.Conv2d(c // 2, 2 * c, 1, bias=False), nn.BatchNorm2d(2 * c)
        self.down, self.db = nn.Conv2d(c, 2 * c, 1, 2, bias=False), nn.BatchNorm2d(2 * c)
        self.c1, self.cb1 = nn.Conv2d(2 * c, c // 2, 1, bias=False), nn.BatchNorm2d(c // 2)
        self.c2, self.cb2 = nn.Conv2d(c // 2, 2 * c, 3, 1, 1, bias=False), nn.BatchNorm2d(2 * c)
        gen = torch.Generator().manual_seed(2)
        for bn in (m for m in self.modules() if isinstance(m, nn.BatchNorm2d)):
            bn.running_mean.uniform_(-0.5, 0.5, generator=gen)
            bn.running_var.uniform_(0.5, 2.0, generator=gen)
            bn.weight.data.uniform_(0.5, 1.5, generator=gen)

    def forward(self, x):
        h = torch.relu(self.b0(self.stem(x)))
        a = torch.relu(self.ab2(self.a2(torch.relu(self.ab1(self.a1(h))))))
        y = torch.relu(self.ab3(self.a3(a)) + self.db(self.down(h)))
        z = torch.relu(self.cb2(self.c2(torch.relu(self.cb1(self.c1(y))))) + y)
        return z.mean((2, 3))


@needs_library
def test_a_family_kernel_runs_primitives_and_agrees_with_eager():
    model = _Bottlenecks().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 16, 16),),
                            ({0: Dim("batch", min=1, max=8)},))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always")
    gen = torch.Generator().manual_seed(7)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for step, batch in enumerate((4, 2, 3, 1, 4, 3, 2, 1, 3)):
            x = torch.randn(batch + 1, 3, 16, 19, generator=gen)[1:, :, :, 3:]
            if step < 5:
                x = x.contiguous()          # then offset and strided views
            before = x.clone()
            torch.testing.assert_close(rt(x), model(x), **TOL, msg=f"step {step}")
            assert torch.equal(x, before)   # the caller's tensor is never written
        stats = rt.stats()
        assert stats["specialized_region_calls"] > 0 and not stats["compile_failures"]
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources
    for source in sources:
        # 7 convolutions: 5 with relu or none, 2 residual adds written in place
        assert source.count("= onednn_conv_primitive_into") == 2, source
        assert source.count("= onednn_conv_primitive") == 7, source
        assert "7 of 7 convolution(s) on oneDNN" in source, source   # the header's note


@needs_library
def test_shapes_without_a_primitive_run_torchs_call_and_agree():
    # A family whose height varies: primitives for the probes' shapes, torch's fused
    # call (its packed weight kept for that) at the others, never a build at run time.
    model = _Bottlenecks().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 16, 16),),
                            ({0: Dim("batch", min=1, max=4), 2: 8 * Dim("h", min=1, max=4)},))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always")
    gen = torch.Generator().manual_seed(19)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for batch, height in ((2, 16), (3, 24), (1, 32), (4, 16), (2, 24), (3, 32)):
            x = torch.randn(batch, 3, height, 16, generator=gen)
            torch.testing.assert_close(rt(x), model(x), **TOL, msg=f"{batch}x{height}")
        stats = rt.stats()
        assert stats["specialized_region_calls"] > 0 and not stats["compile_failures"]
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert any("= onednn_conv_primitive" in s for s in sources), sources


@needs_library
def test_bf16_chains_run_bf16_primitives_within_bf16s_tolerance():
    # Note [bf16 convolution chains]: the chain's convolutions read bf16 values and
    # weights; their primitives are bf16 ones (tolerance: tests/jit/test_cpu_conv_bf16.py)
    model = _Bottlenecks().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 16, 16),),
                            ({0: Dim("batch", min=1, max=4)},))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always",
                            precision="bf16")
    gen = torch.Generator().manual_seed(23)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for batch in (4, 1, 3, 2, 4, 3):
            x = torch.randn(batch, 3, 16, 16, generator=gen)
            got, want = rt(x), model(x)
            assert got.dtype == torch.float32
            assert float((got - want).abs().max() / want.abs().max()) < 0.03, batch
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources and all("1 chain(s) in bf16 (7 convolution(s)); 7 of 7 convolution(s) "
                           "on oneDNN" in s for s in sources), sources


def _conv_act(attr: str):
    """A convolution followed by one activation the fusion pass folds in."""
    acts = {"relu": torch.relu, "silu": nn.functional.silu, "sigmoid": torch.sigmoid,
            "tanh": torch.tanh, "gelu": nn.functional.gelu,
            "gelu_tanh": lambda v: nn.functional.gelu(v, approximate="tanh"),
            "hardtanh": lambda v: nn.functional.hardtanh(v, -0.5, 0.75),
            "leaky_relu": lambda v: nn.functional.leaky_relu(v, 0.1)}

    class ConvAct(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Conv2d(3, 8, 3, 1, 1)
            self.b = nn.Conv2d(8, 8, 3, 1, 2, dilation=2)

        def forward(self, x):
            return acts[attr](self.b(torch.relu(self.a(x))))
    return ConvAct().eval()


@needs_library
@pytest.mark.parametrize("attr", ["relu", "silu", "sigmoid", "tanh", "gelu", "gelu_tanh",
                                  "hardtanh", "leaky_relu"])
def test_every_mapped_activation_agrees_with_eager(attr):
    model = _conv_act(attr)
    program = dynvm.compile(model, (torch.randn(2, 3, 10, 10),),
                            ({0: Dim("batch", min=1, max=4)},))
    config = h.eager_config(cpu_fusion="always", cpu_channels_last="always")
    gen = torch.Generator().manual_seed(11)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for _ in range(3):
            x = torch.randn(2, 3, 10, 10, generator=gen) * 2
            torch.testing.assert_close(rt(x), model(x), **TOL, msg=attr)
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources and all(s.count("= onednn_conv_primitive") == 2 for s in sources), sources


def _packed(weight, padding, stride, dilation, shape):
    return _mkldnn._reorder_convolution_weight(weight, padding, stride, dilation, 1, shape)


@needs_library
def test_a_primitive_equals_conv2d_across_geometries_and_input_layouts():
    gen = torch.Generator().manual_seed(13)
    library = onednn_api.library()
    for stride, padding, dilation, kernel in (((1, 1), (0, 0), (1, 1), 1),
                                              ((2, 1), (1, 2), (1, 1), 3),
                                              ((1, 2), (2, 1), (2, 1), 3)):
        weight = torch.randn(12, 5, kernel, kernel, generator=gen)
        bias = torch.randn(12, generator=gen)
        shape = (2, 5, 9, 11)
        packed = _packed(weight, list(padding), list(stride), list(dilation), list(shape))
        conv = PrimitiveConv(library, packed, bias,
                             ConvSpec(stride, padding, dilation, False, None), [shape])
        x = torch.randn(shape, generator=gen)
        want = nn.functional.conv2d(x, weight, bias, stride, padding, dilation)
        spread = torch.zeros(2, 6, 9, 22)
        spread[:, 1:, :, ::2] = x
        for view in (x, x.contiguous(memory_format=torch.channels_last),
                     spread[:, 1:, :, ::2]):
            got = conv(view)
            assert got.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(got, want, **TOL)


@needs_library
def test_a_residual_is_written_into_and_a_shape_not_built_runs_torchs_call():
    gen = torch.Generator().manual_seed(17)
    weight, bias = torch.randn(8, 4, 1, 1, generator=gen), torch.randn(8, generator=gen)
    packed = _packed(weight, [0, 0], [1, 1], [1, 1], [2, 4, 6, 6])
    op = SpecOp(CONV_BINARY_INPLACE, (2,), (Var(0), Var(1), Literal(packed), Literal(bias),
                                            *map(Literal, ([0, 0], [1, 1], [1, 1], 1, "add",
                                                           None, "relu", [], ""))),
                0, variant="onednn")
    spec = ConvSpec((1, 1), (0, 0), (1, 1), True, eltwise_of("relu", [], ""))
    # built for batch 2 only; batch 5 (not built) runs the op's own torch call
    conv = PrimitiveConv(onednn_api.library(), packed, bias, spec, [(2, 4, 6, 6)],
                         torch_fallback(op))
    for batch in (2, 5):
        x = torch.randn(batch, 4, 6, 6, generator=gen)
        other = torch.randn(batch, 8, 6, 6, generator=gen)
        want = torch.relu(nn.functional.conv2d(x, weight, bias) + other)
        intos = [other.contiguous(memory_format=torch.channels_last)]
        if batch == 2:
            intos.append(other.clone())     # NCHW: computed aside, copied in
        for into in intos:
            got = conv.into(x, into)
            assert got is into              # written into the residual
            torch.testing.assert_close(into, want, **TOL, msg=f"batch {batch}")
    assert set(conv.by_shape) == {(2, 4, 6, 6)}
    covered = PrimitiveConv(onednn_api.library(), packed, bias,
                            dataclasses.replace(spec, residual=False), [(2, 4, 6, 6)])
    with pytest.raises(RuntimeError, match="no oneDNN primitive"):
        covered(torch.randn(3, 4, 6, 6))


@needs_library
def test_kernels_with_one_weight_share_its_reordered_copies():
    # two kernels (batches) of one convolution read one reordered copy per layout
    gen = torch.Generator().manual_seed(29)
    weight, bias = torch.randn(16, 8, 3, 3, generator=gen), torch.randn(16, generator=gen)
    spec = ConvSpec((1, 1), (1, 1), (1, 1), False, None)
    library = onednn_api.library()
    first = PrimitiveConv(library, _packed(weight, [1, 1], [1, 1], [1, 1], [1, 8, 10, 10]),
                          bias, spec, [(1, 8, 10, 10)])
    second = PrimitiveConv(library, _packed(weight, [1, 1], [1, 1], [1, 1], [2, 8, 10, 10]),
                           bias, spec, [(1, 8, 10, 10), (2, 8, 10, 10)])
    assert second.by_shape[(1, 8, 10, 10)].weights is first.by_shape[(1, 8, 10, 10)].weights
    other = PrimitiveConv(library, _packed(weight + 1, [1, 1], [1, 1], [1, 1],
                                           [1, 8, 10, 10]), bias, spec, [(1, 8, 10, 10)])
    assert other.by_shape[(1, 8, 10, 10)].weights is not first.by_shape[(1, 8, 10, 10)].weights
    for conv in (first, second):
        x = torch.randn(1, 8, 10, 10, generator=gen)
        torch.testing.assert_close(conv(x), nn.functional.conv2d(x, weight, bias, 1, 1), **TOL)


def test_activations_without_an_equal_post_op_stay_on_torch():
    assert eltwise_of("none", [], "") is None
    assert eltwise_of("hardswish", [], "") == ""
    assert eltwise_of("leaky_relu", [], "") == ""     # its slope missing
