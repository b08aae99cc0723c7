"""dynvm's own 1x1 convolution as a chain's step (Note [A 1x1 convolution of our own at a
few rows] in jit/backends/cpu/own_1x1.py): forced on, a chain's 1x1 steps run on it and
agree with oneDNN's and with eager over random batches, offset and strided inputs, fp32
(bf16 chains keep oneDNN's); with the residual's sum and without, with the ReLU and
without, at row counts that are and are not whole 7-row tiles; measured, the verdict is
asked once per geometry and reused.

Tolerance as tests/jit/test_cpu_chain_native.py's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import onednn_api, own_1x1
from dynvm.jit.backends.cpu.onednn_chain import PrimitiveChain, Step
from dynvm.jit.backends.cpu.onednn_conv import ConvSpec, PrimitiveConv, _run_step, eltwise_of
from dynvm.jit.calibration import calibrator_for
from tests.jit import _jit_helpers as h
from tests.jit._onednn import NEEDS_ONEDNN_LIBRARY, native_chain

pytestmark = NEEDS_ONEDNN_LIBRARY
TOL = {"rtol": 1e-4, "atol": 1e-4}
_CL = torch.channels_last


def _own_kernel():
    bound = native_chain()
    # built from this tree, the chain library has the per-step loop and the kernel
    assert bound.run_steps is not None, "the chain library predates own_1x1.c: reinstall"
    if bound.own is None:
        pytest.skip("this CPU has no AVX-512F (the own 1x1 kernel's)")
    return bound


@pytest.fixture
def forced(monkeypatch):
    def force(policy: str) -> None:
        monkeypatch.setattr(own_1x1, "policy", policy)
    return force


def _trio(c_in: int, mid: int, relu: bool, gen):
    """Three 1x1 convolutions as a chain's steps: `a = act(conv1(x))`, `b =
    act(conv2(a))`, then `act(conv3(b) + a)` written into `a` (the residual's sum), with
    their reference in torch."""
    library = onednn_api.library()
    act = eltwise_of("relu", [], "") if relu else None
    weights = [(torch.randn(mid, c, 1, 1, generator=gen) * 0.1, torch.randn(mid, generator=gen))
               for c in (c_in, mid, mid)]
    specs = [ConvSpec((1, 1), (0, 0), (1, 1), residual, act)
             for residual in (False, False, True)]

    def reference(x):
        f = torch.relu if relu else (lambda v: v)
        conv = torch.nn.functional.conv2d
        a = f(conv(x, *weights[0]))
        return f(conv(f(conv(a, *weights[1])), *weights[2]) + a)

    def chain(shapes):
        inner = [(s[0], mid, *s[2:]) for s in shapes]
        convs = [PrimitiveConv(library, w, b, spec, shapes if k == 0 else inner)
                 for k, ((w, b), spec) in enumerate(zip(weights, specs))]
        steps = [Step(convs[0], 0, None, 1), Step(convs[1], 1, None, 2),
                 Step(convs[2], 2, 1, 3)]
        return PrimitiveChain(library, native_chain(), steps, (3,), [(0,), (), (2, 1)],
                              _run_step)
    return chain, reference


@pytest.mark.parametrize("rows_hw,c_in,mid,relu", [
    ((7, 7), 64, 64, True),       # 49 rows: 7 whole tiles
    ((14, 14), 96, 128, True),    # 196 rows, 96 input channels (not a chunk's multiple)
    ((5, 3), 300, 64, False),     # 15 rows: tiles of 7, 7 and 1; 300 = a chunk + 44
    ((1, 1), 64, 192, True)])     # one row, three panels
def test_own_steps_agree_with_onednn_and_torch(forced, rows_hw, c_in, mid, relu):
    _own_kernel()
    gen = torch.Generator().manual_seed(3)
    chain_of, reference = _trio(c_in, mid, relu, gen)
    shape = (1, c_in, *rows_hw)
    forced("always")
    ours = chain_of([shape])
    forced("never")
    theirs = chain_of([shape])
    assert ours.own_steps() == 3 and theirs.own_steps() == 0
    for step in range(3):
        x = torch.randn(1, c_in, rows_hw[0], rows_hw[1] + 2, generator=gen)[..., 2:]
        x = x.contiguous(memory_format=_CL) if step else x    # then a strided view
        got, other, want = ours(x), theirs(x), reference(x)
        torch.testing.assert_close(got, want, **TOL, msg=f"step {step}")
        torch.testing.assert_close(got, other, **TOL, msg=f"step {step}")


def test_what_does_not_fit_stays_on_onednn(forced):
    _own_kernel()
    library = onednn_api.library()
    forced("always")
    relu = eltwise_of("relu", [], "")
    w = torch.randn(64, 64, 1, 1)
    shape = (1, 64, 7, 7)
    cases = {"3x3": (torch.randn(64, 64, 3, 3), ConvSpec((1, 1), (1, 1), (1, 1), False, relu)),
             "strided": (w, ConvSpec((2, 2), (0, 0), (1, 1), False, relu)),
             "48 out": (torch.randn(48, 64, 1, 1), ConvSpec((1, 1), (0, 0), (1, 1), False, relu)),
             "gelu": (w, ConvSpec((1, 1), (0, 0), (1, 1), False, eltwise_of("gelu", [], ""))),
             "bf16": (w.bfloat16(), ConvSpec((1, 1), (0, 0), (1, 1), False, relu,
                                             torch.bfloat16))}
    for name, (weight, spec) in cases.items():
        conv = PrimitiveConv(library, weight, torch.randn(weight.shape[0]), spec, [shape])
        assert not own_1x1.fits(conv, shape), name
    fits = PrimitiveConv(library, w, torch.randn(64), ConvSpec((1, 1), (0, 0), (1, 1),
                                                               False, relu), [shape])
    assert own_1x1.fits(fits, shape)


def test_the_verdict_is_measured_once_per_geometry(forced):
    _own_kernel()
    forced("measure")
    gen = torch.Generator().manual_seed(4)
    chain_of, reference = _trio(64, 128, True, gen)
    shape = (1, 64, 6, 6)
    calibrator = calibrator_for("cpu")
    first = chain_of([shape])
    key = (36, 64, 128, False, True, torch.get_num_threads())
    choice = calibrator.known(own_1x1.QUESTION, key)
    assert choice is not None and set(choice.seconds) == {"onednn", "own"}
    measured = calibrator.measurements
    second = chain_of([shape])
    assert calibrator.measurements == measured     # both geometries answered before
    assert first.own_steps() == second.own_steps()
    x = torch.randn(shape, generator=gen)
    torch.testing.assert_close(second(x), reference(x), **TOL)


class Bottlenecks(nn.Module):
    """A stem and two bottlenecks whose 1x1 convolutions have whole panels of 64 output
    channels (the second adding its input), as ResNet-50's stage 3 and 4 have."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 3, 2, 1)
        self.a1, self.a2, self.a3 = nn.Conv2d(64, 64, 1), nn.Conv2d(64, 64, 3, 1, 1), \
            nn.Conv2d(64, 128, 1)
        self.down = nn.Conv2d(64, 128, 1)
        self.c1, self.c2, self.c3 = nn.Conv2d(128, 64, 1), nn.Conv2d(64, 64, 3, 1, 1), \
            nn.Conv2d(64, 128, 1)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        y = torch.relu(self.a3(torch.relu(self.a2(torch.relu(self.a1(h))))) + self.down(h))
        y = torch.relu(self.c3(torch.relu(self.c2(torch.relu(self.c1(y))))) + y)
        return y.mean((2, 3))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_model_with_own_steps_agrees_with_eager(forced, precision):
    _own_kernel()
    forced("always")
    model = Bottlenecks().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 14, 14),),
                            ({0: Dim("batch", min=1, max=4)},))
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always",
                            precision=precision)
    gen = torch.Generator().manual_seed(6)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for step, batch in enumerate((1, 2, 1, 3, 1, 4, 1, 2, 1, 1)):
            x = torch.randn(batch + 1, 3, 14, 17, generator=gen)[1:, :, :, 3:]
            if step < 5:
                x = x.contiguous()          # then offset and strided views
            got, want = rt(x), model(x)
            if precision == "fp32":
                torch.testing.assert_close(got, want, **TOL, msg=f"step {step}")
            else:   # tolerance: tests/jit/test_cpu_conv_bf16.py
                assert float((got - want).abs().max() / want.abs().max()) < 0.03, step
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources
    own = [s for s in sources if "on dynvm's own kernel" in s]
    if precision == "fp32":     # batch 1's arena is NHWC: its 1x1s with 64-panels are ours
        assert own, sources
    else:
        assert not own, sources


def test_the_question_runs_each_side_over_cold_copies_of_the_weight(forced):
    """Note [The own 1x1 question asked with cold weights]: each candidate run cycles
    through copies of the weight, both sides computing the convolution; beyond MAX_ROWS
    nothing is asked."""
    bound = _own_kernel()
    library = onednn_api.library()
    gen = torch.Generator().manual_seed(9)
    w, b = torch.randn(128, 64, 1, 1, generator=gen) * 0.1, torch.randn(128, generator=gen)
    relu = eltwise_of("relu", [], "")
    shape = (1, 64, 7, 7)
    conv = PrimitiveConv(library, w, b, ConvSpec((1, 1), (0, 0), (1, 1), False, relu),
                         [shape])
    primitive = conv.by_shape[shape]
    own = own_1x1.Own1x1(library, bound.own, conv, primitive)
    n = own_1x1.copies(own)
    weight_bytes = 64 * 128 * 4
    assert n == own_1x1.MAX_COPIES or \
        n * weight_bytes >= 2 * own_1x1.l2_bytes() * torch.get_num_threads()
    assert 1 < n <= own_1x1.MAX_COPIES      # a 32 KiB weight is copied
    candidates = own_1x1._candidates(library, bound.own, primitive, own)
    cold, x, y = candidates["own"].keep
    assert len(cold.onednn_args) == len(cold.own_handles) == n
    assert len({t.data_ptr() for t in cold._panels}) == n
    want = torch.relu(torch.nn.functional.conv2d(x, w, b))
    for name in ("own", "onednn"):
        y.zero_()
        candidates[name]()
        torch.testing.assert_close(y, want, **TOL, msg=name)
    forced("measure")
    wide = (1, 64, 17, 16)          # 272 rows, past MAX_ROWS
    assert own_1x1.MAX_ROWS < 17 * 16
    big = PrimitiveConv(library, w, b, ConvSpec((1, 1), (0, 0), (1, 1), False, relu), [wide])
    calibrator = calibrator_for("cpu")
    asked = calibrator.measurements
    assert own_1x1.own_step(library, bound.own, big, big.by_shape[wide], wide) is None
    assert calibrator.measurements == asked
