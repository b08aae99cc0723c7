"""Convolution + batch norm (folded) + activation / residual add on oneDNN (Note [CPU conv
fusion]): what the pass fuses, agreement with eager (offset and strided views included),
the program's weights untouched by folding, and measurement refusing a rewrite.

Tolerance: folding batch norm into the weight rounds differently from normalizing the
convolution's output; fp32 results agree to rtol 1e-4 / atol 1e-4 here (measured worst
1e-7 absolute on these unit-scale activations).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.fusion import onednn_available
from dynvm.jit.calibration import Calibrator
from dynvm.jit.specialize import specialize
from tests.jit._kernel_run import run_kernel

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                                reason="this torch build has no oneDNN")
TOL = {"rtol": 1e-4, "atol": 1e-4}


class ResidualBlock(nn.Module):
    """conv-bn-relu, conv-bn-add-relu (ResNet's basic block), conv-silu, a depthwise
    strided conv-hardtanh (MobileNet's relu6), and a conv whose output is used twice."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c3 = nn.Conv2d(c, c, 1)
        self.dw = nn.Conv2d(c, c, 3, stride=2, padding=1, groups=c)
        self.c4 = nn.Conv2d(c, c, 1)
        gen = torch.Generator().manual_seed(0)
        for bn in (self.b1, self.b2):     # statistics far from the identity
            bn.running_mean.uniform_(-0.5, 0.5, generator=gen)
            bn.running_var.uniform_(0.5, 2.0, generator=gen)
            bn.weight.data.uniform_(0.5, 1.5, generator=gen)
            bn.bias.data.uniform_(-0.2, 0.2, generator=gen)

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(h)) + h)
        z = nn.functional.silu(self.c3(y))
        d = nn.functional.hardtanh(self.dw(z), 0.0, 6.0)
        e = self.c4(d)
        return e * e


@pytest.fixture(scope="module")
def block():
    model = ResidualBlock().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 12, 12),),
                            ({0: Dim("batch", min=1, max=16)},))
    return model, program


def _kernel(program, x, fusion: str, calibrator: Calibrator | None = None,
            channels_last: str = "measured"):
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: x})
    constants = [t.detach() for t in program.constants]
    kernel = compile_kernel(spec, program, constants, torch.device("cpu"), "test", "strong",
                            CpuOptions(None, fusion=fusion, calibrator=calibrator,
                                       channels_last=channels_last))
    return kernel, region


def test_conv_chains_are_fused_and_batch_norm_folded(block):
    _, program = block
    kernel, _ = _kernel(program, torch.randn(2, 3, 12, 12), "always")
    notes = "\n".join(kernel.notes)
    assert "CONVOLUTION + BATCH_NORM + RELU -> oneDNN convolution (batch norm folded" in notes
    assert "CONVOLUTION + BATCH_NORM + ADD + RELU -> oneDNN convolution" in notes
    assert "CONVOLUTION + SILU -> oneDNN" in notes
    assert "CONVOLUTION + HARDTANH -> oneDNN" in notes
    assert "CONVOLUTION -> oneDNN convolution" in notes        # used twice: conv alone
    assert kernel.source.count("onednn_conv_binary") == 1
    assert "BATCH_NORM" not in "".join(line for line in kernel.source.splitlines()
                                       if not line.lstrip().startswith("#"))


@pytest.mark.parametrize("batch", [1, 5])
def test_fused_convs_agree_with_eager_on_views(block, batch):
    model, program = block
    before = [t.clone() for t in program.constants]
    base = torch.randn(batch, 3, 12, 12, generator=torch.Generator().manual_seed(batch))
    padded = torch.zeros(batch + 1, 4, 14, 15)
    padded[1:, 1:, 2:, 3:] = base
    spread = torch.zeros(batch, 3, 12, 24)
    spread[..., ::2] = base
    for kind, x in (("contiguous", base), ("offset", padded[1:, 1:, 2:, 3:]),
                    ("strided", spread[..., ::2])):
        kernel, region = _kernel(program, x, "always")
        assert "onednn_conv" in kernel.source
        with torch.no_grad():
            torch.testing.assert_close(run_kernel(kernel, region, x), model(x), **TOL,
                                       msg=f"{kind} batch {batch}")
    # folding made its own copies: the program's weights are as they were
    assert all(torch.equal(a, b) for a, b in zip(before, program.constants))


def test_measurement_can_refuse_a_conv_rewrite(block):
    _, program = block
    never = Calibrator("cpu", rounds=1, margin=1.0)
    # batch 1: torch runs these small convolutions on its own kernels, so each is asked
    # (Note [Conv choice in the chain's layout])
    kernel, region = _kernel(program, torch.randn(1, 3, 12, 12), "measured", never)
    assert "onednn_conv" not in kernel.source
    assert sum("stays on torch (oneDNN measured no faster here)" in n
               for n in kernel.notes) == 5
    # the batch norms are folded into torch's convolutions all the same, and agree
    assert sum("batch norm folded into its weight" in n for n in kernel.notes) == 2
    code = "".join(line for line in kernel.source.splitlines()
                   if not line.lstrip().startswith("#"))
    assert "BATCH_NORM" not in code and code.count("CONVOLUTION") == 5
    model = block[0]
    for x in (torch.randn(2, 3, 12, 12), torch.randn(3, 3, 12, 24)[..., ::2]):
        folded, region = _kernel(program, x, "measured", never)
        with torch.no_grad():
            torch.testing.assert_close(run_kernel(folded, region, x), model(x), **TOL)


class ConvThenFlatten(nn.Module):
    """conv + relu, then a view that is valid only on an NCHW-contiguous result."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        return y.view(y.shape[0], -1)


def test_a_fused_conv_gives_its_result_the_layout_the_program_expects():
    # oneDNN returns a channels-last result for an NCHW input once the weight is packed;
    # the program's CONVOLUTION gives NCHW, and the VIEW after it relies on that.
    model = ConvThenFlatten().eval()
    x = torch.randn(2, 3, 10, 12)
    program = dynvm.compile(model, (x,), ({0: Dim("batch", min=1, max=16)},))
    # The NCHW form is the subject: the channels-last chain is off, not measured (a
    # measured choice picked channels-last on a loaded host, 4.14 against 3.91 ms).
    kernel, region = _kernel(program, x, "always", channels_last="off")
    assert "onednn_conv_nchw" in kernel.source
    with torch.no_grad():
        got = run_kernel(kernel, region, x)
        assert got.is_contiguous()
        torch.testing.assert_close(got, model(x), **TOL)
