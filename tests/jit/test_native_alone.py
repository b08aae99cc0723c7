"""Note [A small weight at 17-32 rows on one thread] (jit/backends/cpu/native_alone.py):
a GEMM of 17-32 rows over a weight of at most 2^16 elements runs on dynvm's small-M kernel
on the calling thread; checked against eager over views and a random sequence of shapes,
and that other row counts and larger weights keep their path."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import native_alone, native_linear
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.calibration import Choice
from dynvm.jit.specialize import specialize
from tests.jit._kernel_run import run_kernel_outputs, views

needs_kernel = pytest.mark.skipif(not native_linear.available(),
                                  reason=native_linear.unavailable_reason())


class _Block(nn.Module):
    """The held-out encoder's attention output projection with its residual add
    (256 x 256, LINEAR + ADD), then a larger projection (768 x 256) that stays put."""

    def __init__(self) -> None:
        super().__init__()
        self.o = nn.Linear(256, 256)
        self.up = nn.Linear(256, 768)

    def forward(self, x):
        y = x + self.o(x)
        return self.up(y)


@functools.lru_cache(maxsize=1)
def _program():
    torch.manual_seed(0)
    model = _Block().eval()
    dims = ({0: Dim("batch", min=1, max=64), 1: Dim("seq", min=2, max=64)},)
    return model, dynvm.compile(model, (torch.randn(2, 8, 256),), dims)


class _Answers:
    """A calibrator that answers every question with the first candidate (torch's), so
    that only the unmeasured decisions place a GEMM elsewhere."""

    rounds, margin = 3, 0.05

    def choose(self, kind, key, candidates, *args, **kwargs):
        names = list(candidates() if callable(candidates) else candidates)
        return Choice(names[0], {}, names[0])


def _kernel(program, x):
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: x})
    constants = [t.detach() for t in program.constants]
    options = CpuOptions(None, fusion="measured", prepacked=PrepackCache(),
                         channels_last="off", one_thread="measured",
                         calibrator=_Answers())
    return compile_kernel(spec, program, constants, torch.device("cpu"), "test", "strong",
                          options), region


def test_the_rule_takes_one_row_count_of_17_to_32_over_a_small_fp32_weight():
    small = torch.randn(256, 256)
    if not native_linear.available():
        assert native_alone.applies({32}, small, False) is None
        return
    assert native_alone.applies({17}, small, False) is not None
    assert native_alone.applies({32}, small, False) is not None
    assert native_alone.applies({32}, small.t(), True) is not None   # stored input-major
    for rows in ({16}, {33}, {17, 32}, {1}):
        assert native_alone.applies(rows, small, False) is None
    assert native_alone.applies({32}, torch.randn(257, 256), False) is None
    assert native_alone.applies({32}, small.to(torch.bfloat16), False) is None


def _calls(source: str) -> list[str]:
    return [line.strip() for line in source.splitlines() if "= native_linear" in line]


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 32), (2, 16), (1, 17)])
def test_the_small_projection_runs_on_the_calling_thread(shape):
    model, program = _program()
    torch.manual_seed(shape[0] * 100 + shape[1])
    x = torch.randn(*shape, 256)
    kernel, region = _kernel(program, x)
    calls = _calls(kernel.source)
    assert len(calls) == 1                        # the 256 x 256 one, its add folded in
    assert calls[0].split("(", 1)[1].split(", ")[3] != "None"
    lines = [line.strip() for line in kernel.source.splitlines()]
    at = next(i for i, line in enumerate(lines) if "= native_linear" in line)
    # on one thread: the switch to one thread before it, back to the caller's after
    before = [line for line in lines[:at] if line.startswith("set_threads")]
    assert before and before[-1].endswith("(1)")
    with torch.no_grad():
        for view in views(x).values():
            got = run_kernel_outputs(kernel, region, view)[0]
            torch.testing.assert_close(got, model(view), rtol=1e-4, atol=1e-4)


@needs_kernel
def test_a_random_shape_sequence_matches_eager_and_the_interpreter():
    model, program = _program()
    rng = random.Random(7)
    with dynvm.Runtime(program, jit=False) as interpreter:
        for _ in range(12):
            b, s = rng.randint(1, 4), rng.randint(2, 40)
            x = torch.randn(b, s, 256)
            kernel, region = _kernel(program, x)
            expected = 1 if native_alone.ROWS[0] <= b * s <= native_alone.ROWS[1] else 0
            assert len(_calls(kernel.source)) == expected
            if expected:
                assert "Note [A small weight at 17-32 rows on one thread]" in kernel.source
            else:
                assert "17-32 rows" not in kernel.source
            with torch.no_grad():
                got = run_kernel_outputs(kernel, region, x)[0]
                torch.testing.assert_close(got, model(x), rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(got, interpreter(x), rtol=1e-4, atol=1e-4)
