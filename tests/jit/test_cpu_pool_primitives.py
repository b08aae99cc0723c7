"""Channels-last max pooling on oneDNN primitives built once (Note [oneDNN pooling built
once] in jit/backends/cpu/onednn_pool.py): each primitive equals torch's max pooling
exactly over kernel, stride, padding, dilation and ceil_mode variants (floor mode's
dropped remainder and ceil mode's overhang included), whatever the input's layout; a
shape not built runs torch's call; kernels whose chains hold a max pooling run it on a
primitive and agree with eager over random batches, offset and strided inputs, fp32 and
bf16.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import chain_library, onednn_api
from dynvm.jit.backends.cpu.onednn_pool import PoolSpec, PrimitivePool, pool_arguments
from tests.jit import _jit_helpers as h
from tests.jit._onednn import NEEDS_ONEDNN_LIBRARY

pytestmark = NEEDS_ONEDNN_LIBRARY
TOL = {"rtol": 1e-4, "atol": 1e-4}
_max_pool = torch.ops.aten.max_pool2d_with_indices


@pytest.fixture(autouse=True)
def _primitives_one_by_one(monkeypatch):
    """These tests read each primitive op in a kernel's source: the chain library is
    taken away, as where it was not built (Note [A chain of primitives in one call];
    tests/jit/test_cpu_chain_native.py covers the chains)."""
    monkeypatch.setattr(chain_library, "_find_library", lambda: None)


def _geometries():
    for (height, width), kernel, stride, padding, dilation, ceil in itertools.product(
            ((10, 11), (7, 7), (5, 9)), ((2, 2), (3, 3), (3, 2)), ((1, 1), (2, 2), (3, 3), (2, 1)),
            (0, 1), (1, 2), (False, True)):
        if padding <= min(kernel) // 2:
            yield (height, width), kernel, stride, padding, dilation, ceil


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_primitive_equals_torchs_max_pooling_over_geometries(dtype):
    gen = torch.Generator().manual_seed(3)
    library = onednn_api.library()
    asked = 0
    for (height, width), kernel, stride, padding, dilation, ceil in _geometries():
        x = torch.randn(2, 5, height, width, generator=gen).to(dtype)
        args = (list(kernel), list(stride), [padding], [dilation], ceil)
        want = _max_pool(x, *args)[0]
        spec = PoolSpec.of(*args, dtype)
        assert (spec.out_size(height, 0), spec.out_size(width, 1)) == tuple(want.shape[2:])
        pool = PrimitivePool(library, spec, [tuple(x.shape)])
        spread = torch.zeros(2, 6, height, 2 * width, dtype=dtype)
        spread[:, 1:, :, ::2] = x
        for view in (x.contiguous(memory_format=torch.channels_last), x,
                     spread[:, 1:, :, ::2]):
            got = pool(view)
            assert got.is_contiguous(memory_format=torch.channels_last)
            assert got.dtype == dtype
            assert torch.equal(got, want), (height, width, args)
        asked += 1
    assert asked > 100


def test_torchs_default_stride_and_one_number_arguments():
    # max_pool2d's stride [] means the kernel's; one number stands for both dims
    spec = PoolSpec.of([3], [], [1], [1], False, torch.float32)
    assert (spec.kernel, spec.stride, spec.padding, spec.dilation) == (
        (3, 3), (3, 3), (1, 1), (1, 1))
    x = torch.randn(1, 4, 13, 8)
    pool = PrimitivePool(onednn_api.library(), spec, [tuple(x.shape)])
    assert torch.equal(pool(x), _max_pool(x, [3], [], [1])[0])


def test_arguments_left_out_take_the_schemas_defaults():
    assert pool_arguments([[3, 3]]) == [[3, 3], [], [0], [1], False]
    assert pool_arguments([[3, 3], [2, 2], [1, 1]]) == [[3, 3], [2, 2], [1, 1], [1], False]
    assert pool_arguments([[2], [1], [0], [2], True]) == [[2], [1], [0], [2], True]


def test_a_shape_not_built_runs_the_fallback_and_none_raises():
    spec = PoolSpec.of([3, 3], [2, 2], [1, 1], [1, 1], False, torch.float32)
    calls = []

    def fallback(x):
        calls.append(tuple(x.shape))
        return _max_pool(x, [3, 3], [2, 2], [1, 1])[0]
    pool = PrimitivePool(onednn_api.library(), spec, [(2, 4, 9, 9)], fallback)
    x = torch.randn(3, 4, 9, 9)
    assert torch.equal(pool(x), _max_pool(x, [3, 3], [2, 2], [1, 1])[0])
    assert calls == [(3, 4, 9, 9)]
    pool(torch.randn(2, 4, 9, 9))
    assert calls == [(3, 4, 9, 9)]           # built: no fallback
    covered = PrimitivePool(onednn_api.library(), spec, [(2, 4, 9, 9)])
    with pytest.raises(RuntimeError, match="no oneDNN pooling primitive"):
        covered(torch.randn(1, 4, 9, 9))


class _ConvPoolConv(nn.Module):
    """ResNet's stem in small: convolution + relu, a max pooling, then more convolutions;
    the pooling's ceil_mode and padding as given."""

    def __init__(self, ceil_mode: bool = False, padding: int = 1) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, 2, 1)
        self.pool = nn.MaxPool2d(3, 2, padding, ceil_mode=ceil_mode)
        self.a = nn.Conv2d(16, 8, 1)
        self.b = nn.Conv2d(8, 16, 3, 1, 1)

    def forward(self, x):
        y = self.pool(torch.relu(self.stem(x)))
        return torch.relu(self.b(torch.relu(self.a(y))) + y).mean((2, 3))


@pytest.mark.parametrize("ceil_mode,padding", [(False, 1), (True, 0), (True, 1)])
def test_a_family_kernel_pools_on_a_primitive_and_agrees_with_eager(ceil_mode, padding):
    model = _ConvPoolConv(ceil_mode, padding).eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 23, 23),),
                            ({0: Dim("batch", min=1, max=6)},))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always")
    gen = torch.Generator().manual_seed(5)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for step, batch in enumerate((4, 2, 3, 1, 4, 3, 2, 1, 5)):
            x = torch.randn(batch + 1, 3, 23, 26, generator=gen)[1:, :, :, 3:]
            if step < 5:
                x = x.contiguous()          # then offset and strided views
            before = x.clone()
            torch.testing.assert_close(rt(x), model(x), **TOL, msg=f"step {step}")
            assert torch.equal(x, before)
        stats = rt.stats()
        assert stats["specialized_region_calls"] > 0 and not stats["compile_failures"]
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources
    for source in sources:
        assert source.count("= onednn_pool_primitive") == 1, source
        assert "1 max pooling(s) on oneDNN primitives" in source, source


def test_a_family_whose_height_varies_pools_on_torch_at_shapes_not_built():
    model = _ConvPoolConv().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 16, 16),),
                            ({0: Dim("batch", min=1, max=4), 2: 8 * Dim("h", min=1, max=4)},))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always")
    gen = torch.Generator().manual_seed(9)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for batch, height in ((2, 16), (3, 24), (1, 32), (4, 16), (2, 24), (3, 32)):
            x = torch.randn(batch, 3, height, 16, generator=gen)
            torch.testing.assert_close(rt(x), model(x), **TOL, msg=f"{batch}x{height}")
        assert rt.stats()["specialized_region_calls"] > 0
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert any("= onednn_pool_primitive" in s for s in sources), sources


def test_bf16_chains_pool_on_bf16_primitives():
    model = _ConvPoolConv().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 23, 23),),
                            ({0: Dim("batch", min=1, max=4)},))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always",
                            precision="bf16")
    gen = torch.Generator().manual_seed(21)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for batch in (4, 1, 3, 2, 4, 3):
            x = torch.randn(batch, 3, 23, 23, generator=gen)
            got, want = rt(x), model(x)
            assert got.dtype == torch.float32
            assert float((got - want).abs().max() / want.abs().max()) < 0.03, batch
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources and all("1 chain(s) in bf16" in s and "= onednn_pool_primitive" in s
                           for s in sources), sources


def test_a_max_pooling_outside_a_channels_last_chain_stays_on_torch():
    # channels-last off: nothing is NHWC, the pooling keeps torch's call
    model = _ConvPoolConv().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 23, 23),),
                            ({0: Dim("batch", min=1, max=4)},))
    config = h.eager_config(cpu_fusion="always", cpu_channels_last="off")
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for _ in range(4):
            x = torch.randn(2, 3, 23, 23)
            torch.testing.assert_close(rt(x), model(x), **TOL)
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources and not any("onednn_pool_primitive" in s for s in sources), sources
