"""The convolution choice asked in the layout the convolution runs in (Note [Conv choice in
the chain's layout] in jit/backends/cpu/conv.py), and packed weights per planned batch
(Note [Conv weights for one row or many]): under a strong or family guard both
candidates are timed on channels-last operands, under a weak guard on NCHW ones; both
candidates compute the same on those operands; and kernels built with either answer
agree with eager on offset, strided and channels-last views, and fused channels-last
families on sizes they were not compiled with; kernels planned at different batches pack
their own convolution weights, kernels planned at the same batch share them.

No timing is asserted: the answers are scripted (oneDNN wins, or torch wins), the forms
themselves really run. Tolerance as in test_cpu_conv.py (batch norm folded: 1e-4).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import chain_library, onednn_api
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.fusion import CONV_UNARY, CONV_UNARY_NCHW, onednn_available
from dynvm.jit.specialize import specialize
from tests.jit import _jit_helpers as h
from tests.jit._kernel_run import run_kernel
from tests.jit._scripted_calibrator import ScriptedCalibrator

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                                reason="this torch build has no oneDNN")
TOL = {"rtol": 1e-4, "atol": 1e-4}
CL = torch.channels_last


@pytest.fixture(autouse=True)
def _primitives_one_by_one(monkeypatch):
    """These tests read each primitive op in a kernel's source: the chain library is
    taken away, as where it was not built (Note [A chain of primitives in one call];
    tests/jit/test_cpu_chain_native.py covers the chains)."""
    monkeypatch.setattr(chain_library, "_find_library", lambda: None)


class Bottleneck(nn.Module):
    """ResNet's stem and a bottleneck: conv-bn-relu, max pooling, 1x1 / 3x3 / 1x1 with
    the residual add + relu, then global pooling and a linear head (the tail)."""

    def __init__(self, c: int = 16) -> None:
        super().__init__()
        self.stem, self.b0 = nn.Conv2d(3, c, 7, 2, 3, bias=False), nn.BatchNorm2d(c)
        self.c1, self.b1 = nn.Conv2d(c, c // 2, 1, bias=False), nn.BatchNorm2d(c // 2)
        self.c2, self.b2 = nn.Conv2d(c // 2, c // 2, 3, 1, 1, bias=False), nn.BatchNorm2d(c // 2)
        self.c3, self.b3 = nn.Conv2d(c // 2, c, 1, bias=False), nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, 10)
        gen = torch.Generator().manual_seed(0)
        for bn in (self.b0, self.b1, self.b2, self.b3):   # far from the identity
            bn.running_mean.uniform_(-0.5, 0.5, generator=gen)
            bn.running_var.uniform_(0.5, 2.0, generator=gen)
            bn.weight.data.uniform_(0.5, 1.5, generator=gen)
            bn.bias.data.uniform_(-0.2, 0.2, generator=gen)

    def forward(self, x):
        h = nn.functional.max_pool2d(torch.relu(self.b0(self.stem(x))), 3, 2, 1)
        y = torch.relu(self.b1(self.c1(h)))
        y = torch.relu(self.b2(self.c2(y)))
        y = torch.relu(self.b3(self.c3(y)) + h)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(y, 1), 1))


@pytest.fixture(autouse=True)
def two_torch_threads():
    """Whether torch runs a convolution on oneDNN itself (the question this file is
    about) depends on torch's thread count: at one thread its own kernels take the
    small convolutions. The expectations below are for two threads (this host's), and
    an earlier test in the session may have left one (the suite failed on it)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bottleneck():
    model = Bottleneck().eval()
    dims = {0: Dim("batch", min=1, max=8), 2: 32 * Dim("h", min=1, max=4),
            3: 32 * Dim("w", min=1, max=4)}
    program = dynvm.compile(model, (torch.randn(2, 3, 64, 64),), (dims,))
    return model, program


class _Recording(ScriptedCalibrator):
    """Scripted answers; keeps, per convolution question, what each candidate returned
    on the operands the backend built for it."""

    def __init__(self, winner: str) -> None:
        super().__init__(lambda op, key: {winner: 0.001})
        self.results: list[tuple[str, tuple, dict]] = []

    def choose(self, op, size_class_key, candidates):
        if op.startswith("onednn convolution"):
            forms = candidates()
            with torch.no_grad():
                self.results.append((op, size_class_key,
                                     {name: form() for name, form in forms.items()}))
            candidates = forms
        return super().choose(op, size_class_key, candidates)


def _kernel(program, x, guard: str, calibrator):
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: x})
    constants = [t.detach() for t in program.constants]
    options = CpuOptions(None, fusion="measured", calibrator=calibrator,
                         channels_last="always")
    return compile_kernel(spec, program, constants, torch.device("cpu"), "test", guard,
                          options), region


@pytest.mark.parametrize("guard, asked, layout, batch, questions",
                         [("strong", CONV_UNARY, CL, 1, 3), ("family", CONV_UNARY, CL, 1, 3),
                          ("strong", CONV_UNARY, CL, 2, 0),
                          ("weak", CONV_UNARY_NCHW, torch.contiguous_format, 2, 4)])
def test_the_choice_is_asked_in_the_layout_the_conv_runs_in(bottleneck, guard, asked,
                                                            layout, batch, questions):
    # In a channels-last chain a convolution that torch itself runs on oneDNN is not
    # asked (Note [Conv choice in the chain's layout]): at batch 1 the bottleneck's three
    # small ones run on torch's own kernels and are asked, the 7x7 stem is not; at batch
    # 2 none is. Under a weak guard every one is asked, in NCHW.
    _, program = bottleneck
    calibrator = _Recording("onednn")
    kernel, _ = _kernel(program, torch.randn(batch, 3, 64, 64), guard, calibrator)
    assert len(calibrator.results) == questions
    assert sum("torch's own convolution is oneDNN's here" in n
               for n in kernel.notes) == 4 - questions
    for op, key, results in calibrator.results:
        assert key[4] == asked, (op, key)
        for name, result in results.items():
            assert result.is_contiguous(memory_format=layout), (guard, op, name)
        # the two candidates compute the same on the operands they were timed on
        torch.testing.assert_close(results["onednn"], results["torch"], **TOL, msg=op)
    where = "channels-last" if layout is CL else "NCHW"
    assert sum(f"(measured {where}, oneDNN vs torch" in n for n in kernel.notes) == questions


@pytest.mark.parametrize("winner", ["onednn", "torch"])
def test_either_answer_agrees_with_eager_on_views(bottleneck, winner):
    # batch 1: the bottleneck's three are asked, the stem is fused unasked
    model, program = bottleneck
    kernel, region = _kernel(program, torch.randn(1, 3, 64, 64), "strong",
                             _Recording(winner))
    assert kernel.source.count("= onednn_conv") == (4 if winner == "onednn" else 1)
    gen = torch.Generator().manual_seed(5)
    base = torch.randn(1, 3, 64, 64, generator=gen)
    padded = torch.zeros(2, 4, 66, 67)
    padded[1:, 1:, 2:, 3:] = base
    spread = torch.zeros(1, 3, 64, 128)
    spread[..., ::2] = base
    with torch.no_grad():
        for kind, x in (("contiguous", base), ("offset", padded[1:, 1:, 2:, 3:]),
                        ("strided", spread[..., ::2]), ("channels-last", base.to(
                            memory_format=CL))):
            torch.testing.assert_close(run_kernel(kernel, region, x), model(x), **TOL,
                                       msg=kind)


def test_fused_channels_last_families_agree_with_eager_over_random_shapes(bottleneck):
    # The whole JIT, families on, every convolution fused and the chain channels-last
    # (forced: what the channels-last answer builds, without the timings' cost): sizes
    # the families were not compiled with, offset and strided views, agree with eager
    # and the interpreter.
    model, program = bottleneck
    interp = dynvm.Runtime(program, jit=False)
    gen = torch.Generator().manual_seed(7)
    config = h.eager_config(families=True, cpu_fusion="always", cpu_channels_last="always")
    shapes = [(1, 64, 64), (3, 64, 96), (2, 96, 64)]
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        for step in range(8):
            b, hgt, wid = shapes[int(torch.randint(0, len(shapes), (), generator=gen))]
            x = torch.randn(b + 1, 3, hgt, wid + 3, generator=gen)[1:, :, :, 3:]
            if step % 3 == 0:
                x = x.contiguous()
            got = rt(x)
            msg = f"step {step}: {tuple(x.shape)} {x.stride()}"
            torch.testing.assert_close(got, model(x), **TOL, msg=msg)
            torch.testing.assert_close(got, interp(x), **TOL, msg=msg)
        stats = rt.stats()
        assert stats["specialized_region_calls"] > 0 and not stats["compile_failures"]


def test_each_planned_batch_packs_its_own_conv_weights(bottleneck):
    model, program = bottleneck
    options = CpuOptions(None, fusion="always", channels_last="always")
    region = program.regions[0]
    constants = [t.detach() for t in program.constants]
    kernels, packs = [], []
    for batch in (2, 4, 2, 1):
        x = torch.randn(batch, 3, 64, 64)
        spec = specialize(program, region, {region.live_in[0].index: x})
        kernels.append((batch, compile_kernel(spec, program, constants, torch.device("cpu"),
                                              f"test{batch}", "strong", options)))
        packs.append(options.prepacked.packs)
    if onednn_api.library() is None:
        # four convolutions (and the head's linear, whose key has no batch) at batch 2;
        # batch 4 and batch 1 pack their four convolutions again; batch 2 again shares
        assert packs[1] == packs[0] + 4 and packs[2] == packs[1] and packs[3] == packs[1] + 4
    else:
        # Note [oneDNN primitives built once]: three of the chain's convolutions run
        # primitives with weights of their own (torch's packed copies are not kept alive
        # by them); the residual add of the max pool's result stays on torch's call
        assert all(k.source.count("= onednn_conv_primitive") == 3 for _, k in kernels)
        assert all(k.source.count("= onednn_conv_binary") == 1 for _, k in kernels)
    with torch.no_grad():
        for batch, kernel in kernels:
            x = torch.randn(batch, 3, 64, 64)
            torch.testing.assert_close(run_kernel(kernel, region, x), model(x), **TOL,
                                       msg=f"batch {batch}")
