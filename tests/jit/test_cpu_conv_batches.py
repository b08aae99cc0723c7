"""A family's fused convolution picks its packed weight by the input's batch where
oneDNN's blocking differs between the batches it serves (Note [Conv weights for one row
or many] in jit/backends/cpu/conv.py): the table holds one copy per blocking, the
generated code indexes it by `x.shape[0]`, and every batch agrees with eager, strided
and offset inputs included. And a fused residual add writes into its residual where
that residual dies there and is a fresh fused result (Note [Residual add in place] in
jit/backends/cpu/conv_residual.py), never where conv(x) reads it, with the caller's
tensor untouched.

The geometry is a 128 -> 512 1x1 convolution at 14x14, whose blocking on this
project's AVX-512 host differs at batch 3 from batches 2 and 4 (as ResNet-50's 1024 ->
512 one does, at an eighth of its weight). Whether a CPU's
oneDNN makes them differ is asked of oneDNN itself (the packed copies' descriptors), so
the test holds the backend to what oneDNN says on the machine it runs on.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import chain_library
from dynvm.jit.backends.cpu.conv import PackedPerBatch, _blocking, _packed_per_batch
from dynvm.jit.backends.cpu.fusion import onednn_available
from dynvm.jit.backends.cpu.prepack import PrepackCache
from tests.jit import _jit_helpers as h

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                                reason="this torch build has no oneDNN")
TOL = {"rtol": 1e-4, "atol": 1e-4}
_mkldnn = torch.ops.mkldnn


@pytest.fixture(autouse=True)
def _primitives_one_by_one(monkeypatch):
    """These tests read each primitive op in a kernel's source: the chain library is
    taken away, as where it was not built (Note [A chain of primitives in one call];
    tests/jit/test_cpu_chain_native.py covers the chains)."""
    monkeypatch.setattr(chain_library, "_find_library", lambda: None)


def _differs(weight, size_a, size_b) -> bool:
    pack = [_mkldnn._reorder_convolution_weight(weight, [0, 0], [1, 1], [1, 1], 1, s)
            for s in (size_a, size_b)]
    return _blocking(pack[0]) != _blocking(pack[1])


def test_packed_per_batch_holds_one_copy_per_blocking():
    weight = torch.randn(512, 128, 1, 1) * 0.03
    bias = torch.randn(512)
    cache = PrepackCache()
    got = _packed_per_batch(weight, (0, "conv"), [0, 0], [1, 1], [1, 1], 1,
                            [4, 128, 14, 14], {2, 3, 4}, cache)
    differs = _differs(weight, [3, 128, 14, 14], [4, 128, 14, 14])
    assert isinstance(got, PackedPerBatch) == differs
    if differs:
        assert got.packs[2] is got.packs[4] and got.packs[3] is not got.packs[4]
        assert got.distinct() == 2 and got.packs[:2] == (None, None)
    for batch in (2, 3, 4):
        packed = got.packs[batch] if differs else got
        x = torch.randn(batch, 128, 14, 14).contiguous(memory_format=torch.channels_last)
        out = _mkldnn._convolution_pointwise(x, packed, bias, [0, 0], [1, 1], [1, 1], 1,
                                             "relu", [], "")
        torch.testing.assert_close(out, torch.relu(nn.functional.conv2d(x, weight, bias)),
                                   **TOL)
    # one row: nothing to choose between
    assert not isinstance(_packed_per_batch(weight, (0, "conv"), [0, 0], [1, 1], [1, 1], 1,
                                            [1, 128, 14, 14], {1}, cache), PackedPerBatch)


class _Block(nn.Module):
    """A 1x1 convolution + batch norm + relu, then the residual's shape back."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(128, 512, 1, bias=False), nn.BatchNorm2d(512)
        gen = torch.Generator().manual_seed(0)
        self.bn.running_mean.uniform_(-0.5, 0.5, generator=gen)
        self.bn.running_var.uniform_(0.5, 2.0, generator=gen)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))).mean((2, 3))


def test_a_family_kernel_agrees_with_eager_at_every_batch_of_its_bucket():
    model = _Block().eval()
    program = dynvm.compile(model, (torch.randn(2, 128, 14, 14),),
                            ({0: Dim("batch", min=1, max=8)},))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always")
    gen = torch.Generator().manual_seed(3)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        # contiguous first (a family admits row-major inputs), then offset and strided
        # views of each batch (their own specializations, or the interpreter)
        for step, batch in enumerate((4, 2, 3, 4, 3, 2, 4, 3, 2)):
            x = torch.randn(batch + 1, 128, 14, 16, generator=gen)[1:, :, :, 2:]
            if step < 6:
                x = x.contiguous()
            torch.testing.assert_close(rt(x), model(x), **TOL, msg=f"batch {batch}")
        stats = rt.stats()
        assert stats["specialized_region_calls"] > 0 and not stats["compile_failures"]
        sources = [a.source for a in rt.jit.artifacts.values()]
    weight = model.conv.weight.detach()
    if _differs(weight, [3, 128, 14, 14], [4, 128, 14, 14]):
        # torch's packed copy picked by batch, or oneDNN primitives built per batch
        # (Note [oneDNN primitives built once])
        assert any(".shape[0]]" in s or "= onednn_conv_primitive" in s for s in sources), \
            sources


class _TwoBlocks(nn.Module):
    """A stem conv, a bottleneck whose residual is the stem's fused result (written in
    place), and a one-conv block adding its own input (never in place: conv(x) reads x)."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem, self.b0 = nn.Conv2d(3, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.c1, self.b1 = nn.Conv2d(c, c // 2, 1, bias=False), nn.BatchNorm2d(c // 2)
        self.c2, self.b2 = nn.Conv2d(c // 2, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        self.c3, self.b3 = nn.Conv2d(c, c, 3, 1, 1, bias=False), nn.BatchNorm2d(c)
        gen = torch.Generator().manual_seed(1)
        for bn in (self.b0, self.b1, self.b2, self.b3):
            bn.running_mean.uniform_(-0.5, 0.5, generator=gen)
            bn.running_var.uniform_(0.5, 2.0, generator=gen)

    def forward(self, x):
        h = torch.relu(self.b0(self.stem(x)))
        y = torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(h))))) + h)
        z = torch.relu(self.b3(self.c3(y)) + y)
        return z.mean((2, 3))


def test_a_dying_residual_takes_the_fused_result_in_place():
    # Note [Residual add in place]: the bottleneck's add writes into the stem's result;
    # the one-conv block's does not (its residual is its convolution's input).
    model = _TwoBlocks().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 16, 16),),
                            ({0: Dim("batch", min=1, max=4)},))
    config = h.eager_config(cpu_fusion="always", cpu_channels_last="always")
    gen = torch.Generator().manual_seed(5)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for step in range(4):
            x = torch.randn(3, 3, 16, 19, generator=gen)[1:, :, :, 3:]
            if step % 2:
                x = x.contiguous()
            before = x.clone()
            torch.testing.assert_close(rt(x), model(x), **TOL, msg=f"step {step}")
            assert torch.equal(x, before)      # the caller's tensor is never written
        assert rt.stats()["specialized_region_calls"] > 0
        sources = [a.source for a in rt.jit.artifacts.values()]
    # the bottleneck's add, not the one-conv block's; on torch's in-place call or on a
    # oneDNN primitive writing into the residual (Note [oneDNN primitives built once])
    assert sources and all(s.count("onednn_conv_binary_inplace")
                           + s.count("onednn_conv_primitive_into") == 1 for s in sources), \
        sources
    assert all("1 residual add(s) written into the residual" in s for s in sources)
