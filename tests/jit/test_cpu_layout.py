"""Convolution chains channels-last (Note [Channels-last chains]): one conversion into a
chain and one out, agreement with eager and the interpreter (offset, strided and
channels-last inputs included), the layout in the guard, the measured choice keeping
NCHW, the arena beside converted values, and the member ops' layout rule against torch.

No timing is asserted: the measured choice is forced through a scripted calibrator.
Tolerance as in test_cpu_conv.py (batch norm folded: rtol/atol 1e-4).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.arena import ArenaPool
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.fusion import onednn_available
from dynvm.jit.config import JitConfig
from dynvm.jit.specialize import specialize
from dynvm.vm.errors import ConfigError
from tests.jit import _jit_helpers as h
from tests.jit._kernel_run import run_kernel
from tests.jit._scripted_calibrator import ScriptedCalibrator

TOL = {"rtol": 1e-4, "atol": 1e-4}
CL = torch.channels_last
needs_onednn = pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                                  reason="this torch build has no oneDNN")


class ConvChain(nn.Module):
    """ResNet's and MobileNetV3's block kinds in one chain: conv-bn-relu, max pooling,
    conv-bn-add-relu, a depthwise conv with hardswish (decomposed into add, clamp, mul,
    div), a squeeze-excite scale ([N, C, 1, 1] broadcast), a pointwise conv; then the
    pixels as rows (a PERMUTE, then a copy and a VIEW: views, whose strides depend on
    their operand's; a plain flatten would export as a VIEW that the interpreter itself
    refuses on a channels-last input)."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.dw = nn.Conv2d(c, c, 3, padding=1, groups=c)
        self.se1, self.se2 = nn.Conv2d(c, 4, 1), nn.Conv2d(4, c, 1)
        self.pw = nn.Conv2d(c, c, 1)
        gen = torch.Generator().manual_seed(0)
        for bn in (self.b1, self.b2):
            bn.running_mean.uniform_(-0.5, 0.5, generator=gen)
            bn.running_var.uniform_(0.5, 2.0, generator=gen)

    def forward(self, x):
        h = torch.relu(self.b1(self.c1(x)))
        h = nn.functional.max_pool2d(h, 2)
        h = torch.relu(self.b2(self.c2(h)) + h)
        d = nn.functional.hardswish(self.dw(h))
        s = torch.sigmoid(self.se2(torch.relu(self.se1(d.mean((2, 3), keepdim=True)))))
        y = self.pw(d * s)
        return y.permute(0, 2, 3, 1).reshape(-1, y.shape[1])


@pytest.fixture(scope="module")
def chain():
    model = ConvChain().eval()
    dims = {0: Dim("batch", min=1, max=16), 2: Dim("h", min=8, max=64),
            3: Dim("w", min=8, max=64)}
    program = dynvm.compile(model, (torch.randn(2, 3, 16, 16),), (dims,))
    return model, program


def _kernel(program, x, *, fusion="always", channels_last="always", calibrator=None,
            guard="strong", arena=None, arena_ops="all"):
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: x})
    constants = [t.detach() for t in program.constants]
    # one_thread off: these tests' calibrators answer the layout's questions only
    options = CpuOptions(arena, fusion=fusion, calibrator=calibrator,
                         channels_last=channels_last, arena_ops=arena_ops,
                         one_thread="off")
    return compile_kernel(spec, program, constants, torch.device("cpu"), "test", guard,
                          options), region


def _code(kernel) -> str:
    return "\n".join(line for line in kernel.source.splitlines()
                     if not line.lstrip().startswith("#"))


@pytest.mark.parametrize("fusion", [pytest.param("always", marks=needs_onednn), "off"])
def test_a_chain_of_convolutions_is_converted_once_in_and_once_out(chain, fusion):
    _, program = chain
    kernel, _ = _kernel(program, torch.randn(2, 3, 16, 16), fusion=fusion)
    code = _code(kernel)
    assert code.count("= to_channels_last") == 1
    assert code.count("= exact_nchw") == 1 and "exact_nhwc" not in code
    assert "onednn_conv_nchw" not in code           # no conversion back per convolution
    (note,) = [n for n in kernel.notes if n.startswith("channels-last:")]
    assert "1 chain(s) of 6 convolution(s), 1 conversion(s) in, 1 out" in note
    # the conversion back comes right before the permute, the one op that needs NCHW
    lines = code.splitlines()
    back = next(i for i, line in enumerate(lines) if "= exact_nchw" in line)
    assert "PERMUTE" in next(line for line in lines[back + 1:] if "del " not in line)


def test_off_and_weak_guards_leave_the_layout_alone(chain):
    _, program = chain
    x = torch.randn(2, 3, 16, 16)
    for kernel in (_kernel(program, x, channels_last="off")[0],
                   _kernel(program, x, guard="weak")[0]):
        assert "to_channels_last" not in _code(kernel)
        assert not any(n.startswith("channels-last:") for n in kernel.notes)


def _views(batch: int, height: int, width: int, seed: int):
    base = torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(seed))
    padded = torch.zeros(batch + 1, 4, height + 2, width + 3)
    padded[1:, 1:, 2:, 3:] = base
    spread = torch.zeros(batch, 3, height, 2 * width)
    spread[..., ::2] = base
    return {"contiguous": base, "offset": padded[1:, 1:, 2:, 3:],
            "strided": spread[..., ::2], "channels-last": base.contiguous(memory_format=CL)}


@pytest.mark.parametrize("fusion", [pytest.param("always", marks=needs_onednn), "off"])
@pytest.mark.parametrize("batch", [1, 5])
def test_channels_last_kernels_agree_with_eager_and_the_interpreter(chain, fusion, batch):
    model, program = chain
    interp = dynvm.Runtime(program, jit=False)
    for kind, x in _views(batch, 12, 20, batch).items():
        kernel, region = _kernel(program, x, fusion=fusion)
        assert "to_channels_last" in _code(kernel), kind
        with torch.no_grad():
            got = run_kernel(kernel, region, x)
            torch.testing.assert_close(got, model(x), **TOL, msg=f"{kind} batch {batch}")
            torch.testing.assert_close(got, interp(x), **TOL, msg=f"{kind} batch {batch}")
        assert got.is_contiguous()


@needs_onednn
def test_a_kernel_built_for_one_layout_computes_right_on_another(chain):
    # The guard keeps other layouts away (next test); the code is right for them anyway:
    # every value entering a chain is converted, every value leaving it put back.
    model, program = chain
    views = _views(3, 16, 16, 7)
    for built_for in ("contiguous", "channels-last"):
        kernel, region = _kernel(program, views[built_for])
        for kind, x in views.items():
            with torch.no_grad():
                torch.testing.assert_close(run_kernel(kernel, region, x), model(x), **TOL,
                                           msg=f"built for {built_for}, run on {kind}")


def test_the_layout_is_in_the_guard(chain):
    """A kernel specialized for NCHW never sees a channels-last input: the strong guard
    compares strides, so the call runs in the interpreter (right), then the new layout
    gets its own specialization (right too)."""
    model, program = chain
    x = torch.randn(2, 3, 16, 16)
    config = h.eager_config(cpu_channels_last="always", cpu_fusion="always",
                            guard_failure_sample_rate=1)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        rt(x)
        rt(x)
        assert rt.stats()["specialized_region_calls"] == 1
        (spec,) = rt.jit.regions[0].strong.values()
        assert "to_channels_last" in spec.artifact.source
        nhwc = x.contiguous(memory_format=CL)
        torch.testing.assert_close(rt(nhwc), model(x), **TOL)
        stats = rt.stats()
        assert stats["guard_failures"] == 1 and stats["specialized_region_calls"] == 1
        assert "strides" in stats["regions"][0]["last_guard_failure"]
        torch.testing.assert_close(rt(nhwc), model(x), **TOL)     # its own kernel now
        assert rt.stats()["specialized_region_calls"] == 2
        assert len(rt.jit.regions[0].strong) == 2


def test_random_shape_sequences_agree_with_eager_and_the_interpreter(chain):
    model, program = chain
    interp = dynvm.Runtime(program, jit=False)
    gen = torch.Generator().manual_seed(11)
    config = h.eager_config(cpu_channels_last="always", families=True)
    with dynvm.Runtime(program, jit=config) as rt, torch.no_grad():
        shapes = [(2, 16, 16), (3, 12, 20), (1, 24, 8), (5, 9, 13)]
        for step in range(40):
            shape = shapes[int(torch.randint(0, len(shapes), (), generator=gen))]
            kinds = _views(*shape, step)
            kind = list(kinds)[int(torch.randint(0, len(kinds), (), generator=gen))]
            x = kinds[kind]
            got = rt(x)
            msg = f"step {step}: {kind} {tuple(x.shape)}"
            torch.testing.assert_close(got, model(x), **TOL, msg=msg)
            torch.testing.assert_close(got, interp(x), **TOL, msg=msg)
        stats = rt.stats()
        assert stats["specialized_region_calls"] > 0 and not stats["compile_failures"]


def test_measurement_keeps_nchw_where_channels_last_loses(chain):
    _, program = chain
    x = torch.randn(2, 3, 16, 16)

    def script(faster):
        def answer(op, key):
            assert op == "channels-last region"
            return {faster: 1e-3}   # the other one takes 1 s
        return answer
    losing = ScriptedCalibrator(script("nchw"))
    kernel, region = _kernel(program, x, channels_last="measured", calibrator=losing)
    assert "to_channels_last" not in _code(kernel)
    assert "onednn_conv_nchw" in _code(kernel) or not onednn_available(torch.device("cpu"))
    (note,) = [n for n in kernel.notes if n.startswith("channels-last:")]
    assert "NCHW kept (channels-last measured no faster here" in note
    assert losing.asked and losing.asked[0][0] == "channels-last region"
    winning = ScriptedCalibrator(script("channels_last"))
    kernel, region = _kernel(program, x, channels_last="measured", calibrator=winning)
    assert "to_channels_last" in _code(kernel)
    assert any("(measured, NCHW vs channels-last" in n for n in kernel.notes)


class _RaisingCalibrator(ScriptedCalibrator):
    """Runs the candidates, then fails as a region refusing its timing inputs would."""

    def choose(self, op, size_class_key, candidates):
        if op == "channels-last region":
            raise RuntimeError("index out of range on zero-filled inputs")
        return super().choose(op, size_class_key, candidates)


def test_a_region_that_cannot_be_timed_keeps_nchw(chain):
    model, program = chain
    x = torch.randn(2, 3, 16, 16)
    calibrator = _RaisingCalibrator(lambda op, key: {})
    kernel, region = _kernel(program, x, channels_last="measured", calibrator=calibrator)
    assert "to_channels_last" not in _code(kernel)
    assert any("NCHW kept (not measured: the region raised" in n for n in kernel.notes)
    with torch.no_grad():
        torch.testing.assert_close(run_kernel(kernel, region, x), model(x), **TOL)


def test_the_arena_leaves_channels_last_values_out_and_still_agrees(chain):
    model, program = chain
    x = torch.randn(3, 3, 16, 16)
    pool = ArenaPool(torch.device("cpu"), 1 << 26)
    nchw, _ = _kernel(program, x, channels_last="off", fusion="off", arena=pool)
    nhwc, region = _kernel(program, x, fusion="off", arena=pool)
    assert nchw.arena is not None

    def planned(kernel) -> int:
        return kernel.source.count("# into the arena") if kernel.arena else 0
    # Only values whose interpreter and channels-last layouts agree ([N, C, 1, 1]) may
    # still be planned: an NCHW block would turn the chain back.
    assert planned(nhwc) < planned(nchw)
    with torch.no_grad():
        for _ in range(3):           # leases reused across calls
            torch.testing.assert_close(run_kernel(nhwc, region, x), model(x), **TOL)


# That every member of a chain keeps an NHWC input NHWC (and gives NCHW's values) is
# tests/vm/test_isa_table.py's test_channels_last_members_keep_the_layout: the members
# are OpSpec.channels_last, so the table's test covers each.


def test_config_validates_the_switch():
    with pytest.raises(ConfigError, match="cpu_channels_last"):
        JitConfig(cpu_channels_last="sometimes")


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: layer norm over channels between two permutes, so the chain's
    input is a view of a layer norm's result (an arena block, already channels-last:
    converting it returns it), and the residual add reads it after the next norm."""

    def __init__(self, c: int = 8) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 2, stride=2)
        self.norm, self.norm2 = nn.LayerNorm(c), nn.LayerNorm(c)
        self.dw, self.pw = nn.Conv2d(c, c, 3, padding=1, groups=c), nn.Conv2d(c, c, 1)

    def forward(self, x):
        h = self.norm(self.stem(x).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        n = self.norm2(self.dw(h).permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return h + self.pw(n)


@pytest.mark.parametrize("fusion", [pytest.param("always", marks=needs_onednn), "off"])
def test_a_chain_fed_from_an_arena_block_keeps_the_block_alive(fusion):
    # Regression: a conversion that returned its operand (a view of an arena block) was
    # invisible to the planner, which handed the block to a later result while the chain
    # still read it (the zoo's ConvNeXt went wrong by 1.0).
    model = ConvNeXtBlock().eval()
    x = torch.randn(2, 3, 16, 16)
    program = dynvm.compile(model, (x,), ({0: Dim("batch", min=1, max=8)},))
    pool = ArenaPool(torch.device("cpu"), 1 << 26)
    kernel, region = _kernel(program, x, fusion=fusion, arena=pool)
    assert kernel.arena is not None and "to_channels_last" in _code(kernel)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(run_kernel(kernel, region, x), model(x), **TOL)


class _StoringCalibrator(ScriptedCalibrator):
    """A scripted calibrator that keeps its answers, as the process's one does."""

    def choose(self, op, size_class_key, candidates):
        choice = super().choose(op, size_class_key, candidates)
        self._choices.setdefault((op, size_class_key), choice)
        return choice


@pytest.mark.parametrize("channels_last_s, asked", [(1e-3, 1), (0.9, 2)])
def test_a_clear_layout_verdict_is_reused_at_another_batch(chain, channels_last_s, asked):
    # Note [Layout verdicts across batch sizes]: NCHW takes 1 s; channels-last 1 ms is
    # clear (reused at batch 8, another size class), 0.9 s a close call (asked again).
    _, program = chain
    calibrator = _StoringCalibrator(lambda op, key: {"nchw": 1.0,
                                                     "channels_last": channels_last_s})
    _kernel(program, torch.randn(2, 3, 16, 16), channels_last="measured",
            calibrator=calibrator)
    kernel, _ = _kernel(program, torch.randn(8, 3, 16, 16), channels_last="measured",
                        calibrator=calibrator)
    keys = [key for op, key in calibrator.asked if op == "channels-last region"]
    assert len(keys) == asked and (asked == 1 or keys[0] != keys[1])
    assert "to_channels_last" in _code(kernel)     # both verdicts choose channels-last
    (note,) = [n for n in kernel.notes if n.startswith("channels-last:")]
    assert ("(reused, NCHW vs channels-last" in note) == (asked == 1)
