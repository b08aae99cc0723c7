"""Winograd F(2x2, 3x3) as a chain's step and as its pieces (Note [Winograd F(2x2, 3x3)
for the 3x3s] in jit/backends/cpu/winograd.py): the kernel agrees with torch's conv2d
over random batches, odd heights and widths, channel counts, with the residual's sum and
without, the ReLU and without; what does not fit stays on oneDNN; forced on, a model's
stride-1 3x3 steps run on it in the team's chain and in pieces (halves at batch 1, an
image a piece past it) and agree with eager over random batch sequences with offset
and strided inputs; measured, the verdict is asked once per geometry.

Tolerance as tests/jit/test_cpu_chain_native.py's (the transform's error is 2-9e-6 at
ResNet's widths against an fp64 reference, torch's fp32 1-5e-6).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import (
    chain_halves,
    chain_layout_choice,
    onednn_api,
    onednn_chain,
    winograd,
)
from dynvm.jit.backends.cpu.onednn_conv import ConvSpec, PrimitiveConv, eltwise_of
from dynvm.jit.calibration import calibrator_for
from tests.jit import _jit_helpers as h
from tests.jit._onednn import NEEDS_ONEDNN_LIBRARY, bound_native, native_chain

pytestmark = NEEDS_ONEDNN_LIBRARY
TOL = {"rtol": 1e-4, "atol": 1e-4}
_CL = torch.channels_last


def _kernel():
    bound = native_chain()
    assert bound.run_steps is not None, "the chain library predates winograd.c: reinstall"
    if bound.winograd is None:
        pytest.skip("this CPU has no AVX-512F (the Winograd kernel's)")
    return bound.winograd


@pytest.fixture
def forced(monkeypatch):
    def force(policy: str) -> None:
        monkeypatch.setattr(winograd, "policy", policy)
    return force


def _run(library, kernel, step, primitive, x, y) -> None:
    """The step on NHWC `x` into `y` through the primitive's source and destination
    memory objects, as the chain's loop calls it."""
    memories = dict(primitive.arguments())
    calls = library.calls
    calls.dnnl_memory_set_data_handle(memories[onednn_api.ARG_SRC], x.data_ptr())
    calls.dnnl_memory_set_data_handle(memories[onednn_api.ARG_DST], y.data_ptr())
    args = (onednn_api.ExecArg * 2)(
        onednn_api.ExecArg(onednn_api.ARG_SRC, memories[onednn_api.ARG_SRC]),
        onednn_api.ExecArg(onednn_api.ARG_DST, memories[onednn_api.ARG_DST]))
    assert kernel.call(step.handle, library.stream, 2, args) == 0


@pytest.mark.parametrize("seed", range(3))
def test_the_kernel_agrees_with_torch(seed):
    kernel = _kernel()
    library = onednn_api.library()
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    for trial in range(8):
        n, h, w = rng.randint(1, 4), rng.randint(1, 19), rng.randint(1, 19)
        cin, cout = 16 * rng.randint(1, 6), 16 * rng.randint(1, 6)
        residual, relu = trial % 2 == 1, trial % 3 != 2
        weight = torch.randn(cout, cin, 3, 3, generator=gen) / (9 * cin) ** 0.5
        bias = torch.randn(cout, generator=gen)
        spec = ConvSpec((1, 1), (1, 1), (1, 1), residual,
                        eltwise_of("relu", [], "") if relu else None)
        shape = (n, cin, h, w)
        conv = PrimitiveConv(library, weight, bias, spec, [shape])
        assert winograd.fits(conv, shape)
        primitive = conv.by_shape[shape]
        scratch = winograd.Scratch(library)
        # the team's step, or two pieces of its tiles (one after the other here)
        tiles = winograd.tiles_of(shape)
        split = tiles // 2 if tiles > 1 and trial % 4 == 3 else tiles
        steps = [winograd.Winograd(library, kernel, conv, primitive, 0, split)]
        if split < tiles:
            steps.append(winograd.Winograd(library, kernel, conv, primitive, split,
                                           tiles - split))
        for step in steps:
            scratch.use(step)
        x = torch.randn(shape, generator=gen).contiguous(memory_format=_CL)
        before = torch.randn(n, cout, h, w, generator=gen).contiguous(memory_format=_CL)
        y = before.clone() if residual else torch.full_like(before, float("nan"))
        for step in steps:
            _run(library, kernel, step, primitive, x, y)
        want = torch.nn.functional.conv2d(x.double(), weight.double(), bias.double(),
                                          padding=1)
        want = want + before.double() if residual else want
        want = want.relu() if relu else want
        torch.testing.assert_close(y.double(), want, **TOL, msg=str((shape, cout, trial)))


def test_what_does_not_fit_stays_on_onednn():
    _kernel()
    library = onednn_api.library()
    relu = eltwise_of("relu", [], "")
    shape = (1, 32, 9, 9)
    w = torch.randn(32, 32, 3, 3)
    cases = {"1x1": (torch.randn(32, 32, 1, 1), ConvSpec((1, 1), (0, 0), (1, 1), False, relu)),
             "strided": (w, ConvSpec((2, 2), (1, 1), (1, 1), False, relu)),
             "dilated": (w, ConvSpec((1, 1), (2, 2), (2, 2), False, relu)),
             "unpadded": (w, ConvSpec((1, 1), (0, 0), (1, 1), False, relu)),
             "24 out": (torch.randn(24, 32, 3, 3), ConvSpec((1, 1), (1, 1), (1, 1), False, relu)),
             "gelu": (w, ConvSpec((1, 1), (1, 1), (1, 1), False, eltwise_of("gelu", [], ""))),
             "bf16": (w.bfloat16(), ConvSpec((1, 1), (1, 1), (1, 1), False, relu,
                                             torch.bfloat16))}
    for name, (weight, spec) in cases.items():
        conv = PrimitiveConv(library, weight, torch.randn(weight.shape[0]), spec, [shape])
        assert not winograd.fits(conv, shape), name
    odd = (1, 24, 9, 9)
    conv = PrimitiveConv(library, torch.randn(32, 24, 3, 3), torch.randn(32),
                         ConvSpec((1, 1), (1, 1), (1, 1), False, relu), [odd])
    assert not winograd.fits(conv, odd)       # 24 input channels
    conv = PrimitiveConv(library, w, torch.randn(32),
                         ConvSpec((1, 1), (1, 1), (1, 1), False, relu), [shape])
    assert winograd.fits(conv, shape)


class _Blocks(nn.Module):
    """A stem, a max pool and two bottlenecks whose 3x3s are stride 1 with whole 16s of
    channels, then the global mean; the second's chain (a strided 3x3, a 1x1, a 3x3
    adding its input: a residual's sum in Winograd's store) runs at 16 x 15 (an odd
    width), 64 tiles an image; the first's 3x3 at 32 x 30 runs alone (its residual is read
    after it)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.pool = nn.Conv2d(3, 32, 3, 1, 1), nn.MaxPool2d(3, 2, 1)
        self.a1, self.a2 = nn.Conv2d(32, 16, 1), nn.Conv2d(16, 32, 3, 1, 1)
        self.a3 = nn.Conv2d(32, 64, 3, 2, 1)
        self.c1, self.c2 = nn.Conv2d(64, 32, 1), nn.Conv2d(32, 64, 3, 1, 1)

    def forward(self, x):
        h = self.pool(torch.relu(self.stem(x)))
        a = torch.relu(self.a2(torch.relu(self.a1(h))) + h)
        y = torch.relu(self.a3(a))
        y = torch.relu(self.c2(torch.relu(self.c1(y))) + y)
        return y.mean((2, 3))


def _chains() -> list:
    return [o for o in gc.get_objects() if isinstance(o, onednn_chain.PrimitiveChain)]


@pytest.mark.parametrize("halves", ["always", "never"])
def test_a_model_on_winograd_agrees_with_eager(forced, halves, monkeypatch):
    _kernel()
    forced("always")
    if halves == "always":
        bound_native(chain_halves)
    monkeypatch.setattr(chain_halves, "policy", halves)
    monkeypatch.setattr(chain_layout_choice, "blocked_policy", "never")   # NHWC at 2-4
    threads = torch.get_num_threads()
    torch.set_num_threads(2)             # pieces need two threads
    gc.collect()
    before = {id(c) for c in _chains()}
    model = _Blocks().eval()
    try:
        program = dynvm.compile(model, (torch.randn(2, 3, 64, 60),),
                                ({0: Dim("batch", min=1, max=4)},))
        config = h.eager_config(families=True, cpu_fusion="always",
                                cpu_channels_last="always")
        gen = torch.Generator().manual_seed(7)
        with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
            kept = []
            for step, batch in enumerate((1, 2, 1, 4, 3, 1, 1, 2, 4, 1)):
                x = torch.randn(batch + 1, 3, 64, 63, generator=gen)[1:, :, :, 3:]
                if step % 3 == 0:
                    x = x.contiguous()           # else an offset and strided view
                got, want = rt(x), model(x)
                torch.testing.assert_close(got, want, **TOL, msg=f"step {step}")
                kept.append((got, got.clone()))
            for got, copy in kept:               # no result aliases a later call's
                assert torch.equal(got, copy)
            sources = [a.source for a in rt.jit.artifacts.values()]
            chains = [c for c in _chains() if id(c) not in before]
            assert any("on Winograd" in s for s in sources), sources
            assert sum(c.winograd_steps() for c in chains) >= 2
            if halves == "always":
                calls = [call for c in chains for call in c.halves.values()]
                assert calls, "no arena in pieces"
                wino = [call for call in calls
                        if call.arena.winograd and call.halves.by_helper + call.halves.by_caller]
                assert wino, "no arena with Winograd steps ran in pieces"
                assert all(any(i.startswith("winograd:") for i in call.halves.impls)
                           for call in wino)
                assert {shape[0] for c in chains for shape, call in c.halves.items()
                        if call.halves.by_helper + call.halves.by_caller} - {1}
    finally:
        torch.set_num_threads(threads)


def test_the_verdict_is_measured_once_per_geometry(forced):
    kernel = _kernel()
    forced("measure")
    library = onednn_api.library()
    relu = eltwise_of("relu", [], "")
    shape = (1, 32, 12, 10)
    spec = ConvSpec((1, 1), (1, 1), (1, 1), False, relu)
    weight, bias = torch.randn(48, 32, 3, 3) * 0.05, torch.randn(48)
    calibrator = calibrator_for("cpu")
    conv = PrimitiveConv(library, weight, bias, spec, [shape])
    first = winograd.own_step(library, kernel, conv, conv.by_shape[shape], shape,
                              winograd.Scratch(library))
    key = (shape, 48, False, True, torch.get_num_threads())
    choice = calibrator.known(winograd.QUESTION, key)
    assert choice is not None and set(choice.seconds) == {"onednn", "winograd"}
    asked = calibrator.measurements
    again = PrimitiveConv(library, weight, bias, spec, [shape])
    second = winograd.own_step(library, kernel, again, again.by_shape[shape], shape,
                               winograd.Scratch(library))
    assert calibrator.measurements == asked
    assert (first is None) == (second is None) == (choice.name == "onednn")


def test_the_question_runs_both_sides_over_cold_copies():
    kernel = _kernel()
    library = onednn_api.library()
    relu = eltwise_of("relu", [], "")
    shape = (2, 32, 9, 11)
    weight, bias = torch.randn(32, 32, 3, 3) * 0.05, torch.randn(32)
    conv = PrimitiveConv(library, weight, bias, ConvSpec((1, 1), (1, 1), (1, 1), False, relu),
                         [shape])
    primitive = conv.by_shape[shape]
    step = winograd.Winograd(library, kernel, conv, primitive)
    candidates = winograd._candidates(library, kernel, primitive, step)
    cold, xs, ys, _ = candidates["winograd"].keep
    assert len(xs) == len(ys) == len(cold.onednn_args) == len(cold.own_handles) > 1
    assert len({t.data_ptr() for t in cold._own_tensors}) == len(xs)
    for name in ("winograd", "onednn"):
        for y in ys:
            y.fill_(float("nan"))
        candidates[name]()
        for x, y in zip(xs, ys):
            want = torch.relu(torch.nn.functional.conv2d(x, weight, bias, padding=1))
            torch.testing.assert_close(y, want, **TOL, msg=name)


def test_the_pieces_ask_once_per_image_geometry_at_one_thread(forced):
    """The pieces' question is one image at the calling thread's count, asked whatever
    the team chose and reused by every batch of that geometry; shares under
    MIN_PIECE_TILES tiles ask nothing."""
    kernel = _kernel()
    forced("measure")
    library = onednn_api.library()
    relu = eltwise_of("relu", [], "")
    spec = ConvSpec((1, 1), (1, 1), (1, 1), False, relu)
    weight, bias = torch.randn(32, 32, 3, 3) * 0.05, torch.randn(32)
    calibrator = calibrator_for("cpu")
    shapes = [(1, 32, 13, 12), (3, 32, 13, 12)]
    conv = PrimitiveConv(library, weight, bias, spec, shapes)
    key = ((1, 32, 13, 12), 32, False, True, "one thread")
    new = calibrator.known(winograd.QUESTION, key) is None   # not asked before here
    made = {}
    for shape, parts in zip(shapes, (2, 3)):
        asked = calibrator.measurements
        made[shape] = winograd.pieces(library, kernel, conv, conv.by_shape[shape], parts,
                                      winograd.Scratch(library))
        assert calibrator.measurements == asked + (new and shape[0] == 1)
    choice = calibrator.known(winograd.QUESTION, key)
    assert choice is not None and set(choice.seconds) == {"onednn", "winograd"}
    for shape, parts in zip(shapes, (2, 3)):
        got = made[shape]
        assert (got is None) == (choice.name == "onednn")
        if got is not None:
            assert [p.tiles for p in got] == [42 * shape[0] // parts] * parts
            assert sum(p.tiles for p in got) == winograd.tiles_of(shape)
    small = (1, 32, 7, 7)               # 16 tiles: halves of 8
    conv = PrimitiveConv(library, weight, bias, spec, [small])
    asked = calibrator.measurements
    assert winograd.pieces(library, kernel, conv, conv.by_shape[small], 2,
                           winograd.Scratch(library)) is None
    assert calibrator.measurements == asked
