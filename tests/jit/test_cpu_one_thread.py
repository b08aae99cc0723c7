"""Small ops on the calling thread (Note [Small ops on one thread]): the kernel with its
small ops on one thread agrees with the kernel without and with eager (strided and
offset views included), gives the caller its thread count back (also when it raises),
switches only the calling thread, and asks the calibrator only about ops that may gain
(no GEMM, no view)."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.one_thread import ONE, TEAM, openmp_getter, openmp_setter
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.calibration import Calibrator
from dynvm.jit.specialize import specialize
from tests.jit._kernel_run import run_kernel_outputs, views

pytestmark = pytest.mark.skipif(openmp_setter() is None,
                                reason="no OpenMP runtime found in this process")
TOL = {"rtol": 1e-5, "atol": 1e-5}


class Block(nn.Module):
    """A linear, layer norm, attention-style softmax over heads and a residual."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):                        # x: [batch, seq, d]
        h = self.norm(self.proj(x))
        heads = torch.softmax(h.reshape(x.shape[0], x.shape[1], 4, -1), dim=-1)
        return heads.reshape(x.shape) + h


@functools.lru_cache(maxsize=1)
def _program():
    model = Block().eval()
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=2, max=64)
    return model, dynvm.compile(model, (torch.randn(2, 5, 32),), ({0: batch, 1: seq},))


def _kernel(x, one_thread: str, calibrator=None):
    _, program = _program()
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: x})
    constants = [t.detach() for t in program.constants]
    options = CpuOptions(None, fusion="off", channels_last="off", calibrator=calibrator,
                         prepacked=PrepackCache(), one_thread=one_thread)
    kernel = compile_kernel(spec, program, constants, torch.device("cpu"), "test", "strong",
                            options)
    return kernel, region


@pytest.fixture(autouse=True)
def _two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    openmp_setter()(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(1, 3), (3, 7)])
def test_one_thread_kernel_agrees_with_the_plain_one_and_eager_on_views(shape):
    model, _ = _program()
    base = torch.randn(*shape, 32, generator=torch.Generator().manual_seed(shape[1]))
    for kind, x in views(base).items():
        alone, region = _kernel(x, "always")
        plain, _ = _kernel(x, "off")
        assert "(1)" in alone.source and "finally:" in alone.source, alone.source
        assert "set_threads" not in plain.source
        assert any(note.startswith("one thread:") for note in alone.notes)
        (got,) = run_kernel_outputs(alone, region, x)
        assert openmp_getter()() == 2        # the caller's count is back
        (want,) = run_kernel_outputs(plain, region, x)
        torch.testing.assert_close(got, want, **TOL, msg=kind)
        with torch.no_grad():
            torch.testing.assert_close(got, model(x), **TOL, msg=f"{kind} eager")


def test_a_kernel_that_raises_on_one_thread_gives_the_count_back():
    x = torch.randn(2, 5, 32)
    kernel, region = _kernel(x, "always")
    regs: list = [None] * 1024
    # The right shape for the guard's eyes, the wrong width for layer norm: the kernel
    # raises inside its one-thread run.
    regs[region.live_in[0].index] = torch.randn(2, 5, 31)
    with pytest.raises(RuntimeError):
        kernel.fn(regs)
    assert openmp_getter()() == 2


def test_the_switch_is_the_calling_threads_own():
    setter = openmp_setter()
    seen = {}

    def other():
        torch.set_num_threads(2)
        setter(1)
        seen["inside"] = openmp_getter()()
    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen["inside"] == 1
    assert openmp_getter()() == 2


def test_only_ops_that_may_gain_are_asked():
    calibrator = Calibrator("cpu", rounds=3)
    _kernel(torch.randn(2, 5, 32), "measured", calibrator=calibrator)
    asked = {key[0] for (op, key) in calibrator.entries() if op == "one thread"}
    assert "LAYER_NORM" in asked and "SOFTMAX" in asked, asked
    assert not asked & {"LINEAR", "ADDMM", "VIEW", "PERMUTE"}, asked
    for (op, _), choice in calibrator.entries().items():
        if op == "one thread":
            assert set(choice.seconds) == {TEAM, ONE}


class Attention(nn.Module):
    """Layer norm around masked SDPA: the norm may be asked, SDPA never."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x, keep):                  # x: [batch, seq, d]; keep: [batch, seq]
        q, k, v = (t.reshape(x.shape[0], x.shape[1], 4, -1).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        mask = keep[:, None, None, :]
        h = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask)
        return self.norm(h.transpose(1, 2).reshape(x.shape) + x)


def test_sdpa_is_never_asked():
    model = Attention().eval()
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=32)
    example = (torch.randn(2, 5, 32), torch.ones(2, 5, dtype=torch.bool))
    program = dynvm.compile(model, example, ({0: batch, 1: seq}, {0: batch, 1: seq}))
    region = program.regions[0]
    x, keep = torch.randn(2, 16, 32), torch.rand(2, 16) > 0.3
    keep[:, 0] = True
    probe = dict(zip((v.index for v in region.live_in), (x, keep), strict=False))
    spec = specialize(program, region, probe)
    assert "SDPA" in {op.opcode for op in spec.ops}
    calibrator = Calibrator("cpu", rounds=2)
    options = CpuOptions(None, fusion="off", channels_last="off", calibrator=calibrator,
                         prepacked=PrepackCache(), one_thread="measured")
    compile_kernel(spec, program, [t.detach() for t in program.constants],
                   torch.device("cpu"), "test", "strong", options)
    asked = {key[0] for (op, key) in calibrator.entries() if op == "one thread"}
    assert "LAYER_NORM" in asked and "SDPA" not in asked, asked



_TORCHS_RUNTIME = """
import os, torch, ctranslate2
from dynvm.jit.backends.cpu.one_thread import openmp_runtime
runtime = openmp_runtime()
with open("/proc/self/maps") as maps:
    mapped = {line.split()[-1] for line in maps if "libgomp" in line}
torchs = os.path.join(os.path.dirname(os.path.dirname(torch.__file__)), "torch")
assert len(mapped) > 1, mapped                      # CTranslate2's own beside torch's
assert runtime._name.startswith(torchs), (runtime._name, mapped)
assert runtime.omp_get_max_threads() == torch.get_num_threads()
print("torch's")
"""


def test_the_openmp_runtime_is_torchs_beside_another_packages():
    # CTranslate2's wheel maps a libgomp of its own, whose path sorts before torch's: the
    # thread counts the helper threads read and set must still be torch's team's (with
    # CTranslate2's runtime, a chain in pieces read 1 thread and never ran its pieces).
    # In a child process: CTranslate2's runtime is not left in this one.
    if importlib.util.find_spec("ctranslate2") is None:
        pytest.skip("ctranslate2 (the bench extra) is not installed")
    child = subprocess.run([sys.executable, "-c", _TORCHS_RUNTIME], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0 and "torch's" in child.stdout, child.stderr[-2000:]


class Norm(nn.Module):
    """A residual add and layer norm at BERT's width: its rows reach 2^16-2^17 elements."""

    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)

    def forward(self, x):                        # x: [batch, seq, d]
        return self.norm(x + 1.0)


@functools.lru_cache(maxsize=1)
def _norm_program():
    model = Norm().eval()
    batch, seq = Dim("batch", min=1, max=16), Dim("seq", min=2, max=512)
    return model, dynvm.compile(model, (torch.randn(2, 5, 256),), ({0: batch, 1: seq},))


def _norm_kernel(x, calibrator):
    _, program = _norm_program()
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: x})
    options = CpuOptions(None, fusion="off", channels_last="off", calibrator=calibrator,
                         prepacked=PrepackCache(), one_thread="measured")
    kernel = compile_kernel(spec, program, [t.detach() for t in program.constants],
                            torch.device("cpu"), "test", "strong", options)
    return kernel, region


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_layer_norm_goes_on_one_thread_unasked_up_to_its_bound(seed):
    """Note [Layer norm on one thread in the call]: past MAX_ELEMENTS layer norm is not
    asked and runs on the calling thread up to ALWAYS_ONE's bound, the team past it."""
    from dynvm.jit.backends.cpu.one_thread import ALWAYS_ONE, MAX_ELEMENTS
    model, _ = _norm_program()
    gen = torch.Generator().manual_seed(seed)
    bound = ALWAYS_ONE["LAYER_NORM"]
    # random rows with 2^16 < elements <= 2^17, then past 2^17
    inside = (int(torch.randint(1, 3, (1,), generator=gen)), 0)
    inside = (inside[0], int(torch.randint(MAX_ELEMENTS // (256 * inside[0]) + 1,
                                           bound // (256 * inside[0]) + 1, (1,),
                                           generator=gen)))
    past = (int(torch.randint(5, 9, (1,), generator=gen)), 0)
    past = (past[0], int(torch.randint(bound // (256 * past[0]) + 1, 513, (1,),
                                       generator=gen)))
    for (batch, seq), on_one in ((inside, True), (past, False)):
        assert (batch * seq * 256 <= bound) == on_one and batch * seq * 256 > MAX_ELEMENTS
        base = torch.randn(batch, seq, 256, generator=gen)
        for kind, x in views(base).items():
            calibrator = Calibrator("cpu", rounds=2)
            kernel, region = _norm_kernel(x, calibrator)
            asked = {key[0] for (op, key) in calibrator.entries() if op == "one thread"}
            assert "LAYER_NORM" not in asked, asked
            note = next((n for n in kernel.notes if n.startswith("one thread:")), "")
            assert ("LAYER_NORM" in note) == on_one, (batch, seq, kernel.notes)
            (got,) = run_kernel_outputs(kernel, region, x)
            assert openmp_getter()() == 2
            with torch.no_grad():
                torch.testing.assert_close(got, model(x), **TOL, msg=f"{kind} {batch}x{seq}")
