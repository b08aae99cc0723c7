"""Convolution chains in bf16 under `precision="bf16"` (Note [bf16 convolution chains]
in jit/backends/cpu/chain_bf16.py): a chain of fused convolutions, pooling and a
residual runs in bf16 with casts only at its ends, agrees with the fp32 interpreter
within bf16's tolerance at batches the family never saw and on strided and offset
inputs; a chain fed a broadcast operand from outside stays fp32 (and exact); fp32 keeps
its kernels as they were.

Tolerance: bf16 rounds every convolution's input, weight and output to 8 bits of
mantissa; through this model's five convolutions and a residual the largest |out -
fp32| measured 0.3-0.6% of the largest |fp32| (ResNet-50 at 224: 0.4%, bench/
precision_accuracy.py). The tests hold 3% (tests/jit/test_cpu_precision.py's bf16
tolerance), far below what a wrong weight, bias, layout or cast gives (O(1)).
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu.chain_bf16 import bf16_supported
from dynvm.jit.backends.cpu.fusion import onednn_available
from tests.jit import _jit_helpers as h

pytestmark = pytest.mark.skipif(
    not onednn_available(torch.device("cpu")) or not bf16_supported(),
    reason="this torch build or CPU has no oneDNN bf16")
RELATIVE = 3e-2


def _bn(c: int, gen) -> nn.BatchNorm2d:
    bn = nn.BatchNorm2d(c)
    bn.running_mean.uniform_(-0.5, 0.5, generator=gen)
    bn.running_var.uniform_(0.5, 2.0, generator=gen)
    return bn


class _Net(nn.Module):
    """ResNet in small: stem conv + bn + relu, max pooling, a bottleneck with a
    downsampling shortcut (its fused residual add), a keepdim mean, a linear head; with
    `scale`, a squeeze-excite style gate from outside the chain multiplies the stem."""

    def __init__(self, c: int = 16, scale: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(2)
        self.scale = scale
        self.stem, self.b0 = nn.Conv2d(3, c, 5, 2, 2, bias=False), _bn(c, gen)
        self.c1, self.b1 = nn.Conv2d(c, c // 2, 1, bias=False), _bn(c // 2, gen)
        self.c2, self.b2 = nn.Conv2d(c // 2, c // 2, 3, 2, 1, bias=False), _bn(c // 2, gen)
        self.c3, self.b3 = nn.Conv2d(c // 2, 2 * c, 1, bias=False), _bn(2 * c, gen)
        self.down, self.bd = nn.Conv2d(c, 2 * c, 1, 2, bias=False), _bn(2 * c, gen)
        self.gate = nn.Linear(c, c)
        self.head = nn.Linear(2 * c, 10)

    def forward(self, x):
        h = torch.relu(self.b0(self.stem(x)))
        if self.scale:
            h = h * torch.sigmoid(self.gate(h.mean((2, 3)))).reshape(h.shape[0], -1, 1, 1)
        h = nn.functional.max_pool2d(h, 3, 2, 1)
        y = torch.relu(self.b1(self.c1(h)))
        y = torch.relu(self.b2(self.c2(y)))
        y = torch.relu(self.b3(self.c3(y)) + self.bd(self.down(h)))
        return self.head(y.mean((2, 3), keepdim=True).flatten(1))


@functools.lru_cache(maxsize=2)
def _program(scale: bool):
    model = _Net(scale=scale).eval()
    return model, dynvm.compile(model, (torch.randn(2, 3, 32, 32),),
                                ({0: Dim("batch", min=1, max=8)},))


def _relative(actual, expected) -> float:
    return float((actual - expected).abs().max() / expected.abs().max())


def _run(scale: bool, precision: str, inputs):
    model, program = _program(scale)
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always",
                            precision=precision)
    outs = []
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for x in inputs:
            outs.append((rt(x), model(x)))
        stats = rt.stats()
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert stats["specialized_region_calls"] > 0 and not stats["compile_failures"], stats
    # the kernel header (its first lines, comments) says what each pass chose
    notes = [line for s in sources for line in s.splitlines() if "channels-last:" in line]
    assert notes, sources
    return outs, notes, sources


def _inputs():
    gen = torch.Generator().manual_seed(7)
    # family bounds first, then batches between them and views of them
    contiguous = [torch.randn(b, 3, 32, 32, generator=gen) for b in (4, 1, 3, 2, 4)]
    offset = torch.randn(4, 3, 34, 35, generator=gen)[1:, :, 2:, 3:]
    strided = torch.randn(2, 3, 32, 64, generator=gen)[..., ::2]
    return [*contiguous, offset, strided]


def test_a_conv_chain_runs_bf16_between_its_ends_and_stays_within_tolerance():
    outs, notes, sources = _run(False, "bf16", _inputs())
    for index, (got, expected) in enumerate(outs):
        assert got.dtype == torch.float32 and got.shape == expected.shape
        assert _relative(got, expected) < RELATIVE, index
    text = "\n".join(notes)
    assert "1 chain(s) in bf16 (5 convolution(s))" in text, text
    for source in sources:   # casts only where the layout converts: in, and out (the mean)
        # Note [A chain's input conversion and global mean]: the cast in is the chain's
        # first step where its native library runs it
        assert "= to_channels_last_bf16" in source or "1 input conversion(s)" in source
        assert "= exact_nchw_fp32" in source
        assert not re.search(r"= (to_channels_last|exact_nchw|exact_nhwc)\d+\(", source)


def test_a_chain_fed_a_broadcast_operand_from_outside_stays_fp32():
    outs, notes, sources = _run(True, "bf16", _inputs()[:5])
    text = "\n".join(notes)
    assert "kept fp32" in text and "in bf16" not in text, text
    assert not any("to_channels_last_bf16" in s for s in sources)
    for got, expected in outs:   # its GEMMs (the gate, the head) are still bf16
        assert _relative(got, expected) < RELATIVE


def test_fp32_kernels_have_no_bf16_chain():
    outs, notes, sources = _run(False, "fp32", _inputs()[:5])
    assert not any("bf16" in n for n in notes)
    assert not any("bf16" in s for s in sources)
    for got, expected in outs:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
