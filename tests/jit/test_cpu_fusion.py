"""GEMM + epilogue on oneDNN (Note [CPU fusion]): which ops the pass rewrites, that the
rewritten kernel agrees with the unfused kernel and with eager (strided and offset views
included), that measurement can refuse a rewrite, and that packed weights are shared by
an engine's kernels and freed with them (Note [Prepacked weights]).

Tolerance: oneDNN accumulates the GEMM in another order than torch's BLAS and computes
GELU/SiLU with its own polynomial; fp32 results agree to rtol 1e-4 / atol 1e-4 on these
unit-scale activations (measured worst: 1.3e-4 absolute at K=1024, 3e-5 at K<=256).
"""

from __future__ import annotations

import functools
import gc
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.cli import main
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.fusion import fuse_gemm_epilogues, is_fused, onednn_available
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.calibration import Calibrator
from dynvm.jit.specialize import specialize
from tests.jit._kernel_run import run_kernel_outputs, views

h = importlib.import_module("tests.jit._jit_helpers")

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                                reason="this torch build has no oneDNN")
TOL = {"rtol": 1e-4, "atol": 1e-4}


class Epilogues(nn.Module):
    """Every GEMM form the pass knows, each followed by an epilogue it can fuse, plus
    one it cannot (a GEMM result used twice)."""

    def __init__(self, d: int = 32, f: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(d, f)
        self.down = nn.Linear(f, d)
        self.w_mm = nn.Parameter(torch.randn(d, f) / d ** 0.5)
        self.w_add = nn.Parameter(torch.randn(d, f) / d ** 0.5)
        self.b_add = nn.Parameter(torch.randn(f))
        self.w_mat = nn.Parameter(torch.randn(f, d) / f ** 0.5)
        self.twice = nn.Linear(d, d)

    def forward(self, x):                       # x: [batch, seq, d]
        h = torch.nn.functional.gelu(self.up(x))              # LINEAR + GELU
        y = x + self.down(h)                                   # LINEAR + ADD (residual)
        flat = y.reshape(-1, y.shape[-1])
        a = torch.relu(flat @ self.w_mm)                       # MM/MATMUL + RELU
        b = torch.sigmoid(torch.addmm(self.b_add, flat, self.w_add))   # ADDMM + SIGMOID
        c = torch.tanh(torch.matmul(a * b, self.w_mat))       # MM/MATMUL + TANH
        t = self.twice(y)                                      # used twice: no epilogue
        return c.reshape(y.shape) + t * t


@functools.lru_cache(maxsize=1)
def _program():
    """The model and its program, lowered once for the module (export costs seconds)."""
    model = Epilogues().eval()
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=2, max=64)
    return model, dynvm.compile(model, (torch.randn(2, 5, 32),),
                                ({0: batch, 1: seq},))


def _kernel(program, x: torch.Tensor, fusion: str, prepacked: PrepackCache | None = None,
            calibrator: Calibrator | None = None):
    """compile_kernel of region 0 for `x` (its real strides) with these options."""
    region = program.regions[0]
    spec = specialize(program, region, {region.live_in[0].index: x})
    constants = [t.detach() for t in program.constants]
    # torch's fused calls themselves: the primitives pass off (tests/jit/
    # test_cpu_linear_primitives.py covers it)
    options = CpuOptions(None, fusion=fusion, calibrator=calibrator,
                         prepacked=prepacked or PrepackCache(), linear_primitives="off")
    kernel = compile_kernel(spec, program, constants, torch.device("cpu"), "test", "strong",
                            options)
    return kernel, spec, region



def test_every_gemm_form_with_its_epilogue_is_fused():
    _, program = _program()
    kernel, spec, _ = _kernel(program, torch.randn(3, 7, 32), "always")
    assert sum(is_fused(op) for op in spec.ops) == 0  # the IR is untouched
    fused = [line for line in kernel.notes if "oneDNN" in line]
    text = "\n".join(fused)
    for expected in ("LINEAR + GELU", "LINEAR + ADD", "+ RELU", "ADDMM + SIGMOID",
                     "+ TANH", "post-op gelu", "binary post-op add"):
        assert expected in text, (expected, text)
    # the linear whose result is used twice keeps its result: a plain oneDNN linear
    assert any("LINEAR -> oneDNN linear (" in line for line in fused)
    assert "onednn_linear" in kernel.source and "onednn_linear_binary" in kernel.source


@pytest.mark.parametrize("shape", [(1, 2), (3, 7), (16, 33)])
def test_fused_kernel_agrees_with_unfused_and_eager_onviews(shape):
    model, program = _program()
    gen = torch.Generator().manual_seed(shape[0] * 100 + shape[1])
    base = torch.randn(*shape, 32, generator=gen)
    for kind, x in views(base).items():
        fused, _, region = _kernel(program, x, "always")
        plain, _, _ = _kernel(program, x, "off")
        assert "onednn" not in plain.source
        (got,), (want,) = run_kernel_outputs(fused, region, x), run_kernel_outputs(plain, region, x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL, msg=f"{kind} {shape}")
        with torch.no_grad():
            torch.testing.assert_close(got, model(x), **TOL, msg=f"{kind} {shape} eager")


def test_a_rewrite_that_does_not_measure_faster_is_not_made():
    _, program = _program()
    x = torch.randn(2, 5, 32)
    never = Calibrator("cpu", rounds=1, margin=1.0)    # must take no time at all: never
    kernel, _, region = _kernel(program, x, "measured", calibrator=never)
    assert "onednn" not in kernel.source
    assert any(re.search(r"stays on torch \(oneDNN measured no faster here: M=\d+ oneDNN "
                         r"[\d.]+ vs torch [\d.]+ ms\)", n) for n in kernel.notes), kernel.notes
    assert never.measurements > 0
    fair = Calibrator("cpu", rounds=3)
    kernel, _, _ = _kernel(program, x, "measured", calibrator=fair)
    # every GEMM was measured at its M (2 x 5 rows); each note says which way it went
    gemm_notes = [n for n in kernel.notes if "oneDNN" in n]
    assert len(gemm_notes) == 6, kernel.notes
    assert all("torch: M=10 " in n or "stays on torch" in n for n in gemm_notes)
    assert kernel.source.count("onednn_linear") == sum("torch: M=10 " in n
                                                       for n in gemm_notes)
    # a second compile of the same sizes asks the cache, not the clock
    before = fair.measurements
    _kernel(program, x, "measured", calibrator=fair)
    assert fair.measurements == before
    torch.testing.assert_close(run_kernel_outputs(kernel, region, x)[0],
                               run_kernel_outputs(_kernel(program, x, "off")[0], region, x)[0],
                               **TOL)


def test_packed_weights_are_shared_by_kernels_and_freed_with_them():
    _, program = _program()
    cache = PrepackCache()
    first, _, _ = _kernel(program, torch.randn(2, 5, 32), "always", prepacked=cache)
    packed = cache.alive()
    assert packed == 6 and cache.packs == 6   # up, down, mm, addmm, matmul, twice
    second, _, _ = _kernel(program, views(torch.randn(2, 5, 32))["offset"], "always",
                           prepacked=cache)
    assert cache.packs == 6                   # same batch hint (M=10): shared
    other_m, _, _ = _kernel(program, torch.randn(7, 3, 32), "always", prepacked=cache)
    assert cache.packs == 6                   # another M (21) shares them too
    del other_m
    del first
    gc.collect()
    assert cache.alive() == packed               # the second kernel still holds them
    del second
    gc.collect()
    assert cache.alive() == 0                    # freed with the last kernel


def test_weak_guard_gets_no_binary_fusion():
    _, program = _program()
    region = program.regions[0]
    x = torch.randn(2, 5, 32)
    spec = specialize(program, region, {region.live_in[0].index: x})
    constants = [t.detach() for t in program.constants]
    weak = fuse_gemm_epilogues(spec, constants, torch.device("cpu"),
                               prepacked=PrepackCache(), calibrator=None, weak_guard=True)
    assert not any(op.opcode == "ONEDNN_LINEAR_BINARY" for op in weak.spec.ops)
    assert any(is_fused(op) for op in weak.spec.ops)


def test_demo_transformer_in_the_runtime_agrees_with_eager():
    """The default (measured) path end to end: whatever the calibration chose on this
    machine, specialized calls agree with eager on a random shape sequence."""
    demo = h.demo("transformer")
    program = h.compiled("transformer")
    gen = torch.Generator().manual_seed(7)
    sizes = [(2, 8), (2, 8), (4, 3), (2, 8), (1, 17), (4, 3), (4, 3)]
    with dynvm.Runtime(program, jit=h.eager_config()) as rt:
        for b, s in sizes:
            x = torch.randn(b, s, h.SMALL_TRANSFORMER["hidden"], generator=gen)
            with torch.no_grad():
                want = demo.module(x)
            torch.testing.assert_close(rt(x), want, **TOL)
        stats = rt.stats()
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert stats["specialized_region_calls"] > 0
    assert all("oneDNN" in s or "stays on torch" in s for s in sources)


@pytest.mark.parametrize("fusion", ["always", "off"])
def test_jit_config_cpu_fusion_reaches_the_backend(fusion):
    program = h.compiled("transformer")
    x = torch.randn(2, 8, h.SMALL_TRANSFORMER["hidden"])
    with dynvm.Runtime(program, jit=h.eager_config(cpu_fusion=fusion)) as rt:
        rt(x)
        rt(x)
        sources = "".join(a.source for a in rt.jit.artifacts.values())
    assert sources
    assert ("onednn_linear" in sources) == (fusion == "always")
    with pytest.raises(ValueError, match="cpu_fusion"):
        h.eager_config(cpu_fusion="sometimes")


def test_a_family_kernel_fused_at_its_upper_bound_runs_every_member():
    """A family is specialized at several probes (the upper bound plans, Note [Probes]);
    the weights are packed for the upper bound's M and serve every M in the family."""
    model, program = _program()
    region = program.regions[0]
    reg = region.live_in[0].index
    probes = [{reg: torch.empty(b, s, 32, device="meta")} for b, s in ((16, 33), (1, 2),
                                                                        (2, 3))]
    spec = specialize(program, region, probes[0], tuple(probes[1:]))
    constants = [t.detach() for t in program.constants]
    options = CpuOptions(None, fusion="always", linear_primitives="off")
    kernel = compile_kernel(spec, program, constants, torch.device("cpu"), "test", "family",
                            options)
    assert "onednn_linear_binary" in kernel.source
    gen = torch.Generator().manual_seed(3)
    for b, s in ((16, 33), (1, 2), (5, 7), (9, 20)):
        x = torch.randn(b, s, 32, generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(run_kernel_outputs(kernel, region, x)[0], model(x), **TOL,
                                       msg=f"family member {(b, s)}")


def test_demo_transformer_forced_onto_onednn_agrees_with_eager_onviews():
    demo = h.demo("transformer")
    program = h.compiled("transformer")
    gen = torch.Generator().manual_seed(11)
    for b, s in ((1, 2), (3, 9)):
        base = torch.randn(b, s, h.SMALL_TRANSFORMER["hidden"], generator=gen)
        for kind, x in views(base).items():
            kernel, _, region = _kernel(program, x, "always")
            assert kernel.source.count("onednn_linear_binary") == 2 * 2   # 2 per layer
            with torch.no_grad():
                torch.testing.assert_close(run_kernel_outputs(kernel, region, x)[0], demo.module(x),
                                           **TOL, msg=f"{kind} {(b, s)}")


_TEAM_SCRIPT = """
import os, threading, torch
from dynvm.jit.backends.cpu.fusion import pin_openmp_team

def tids():
    return set(os.listdir("/proc/self/task"))

a, w = torch.randn(512, 512), torch.randn(512, 512)
packed = torch.ops.mkldnn._reorder_linear_weight(w, 512)
torch.set_num_threads(2)
torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")   # main thread, 2
torch.set_num_threads(1)                                              # then serving on 1
for pin in (False, True):
    started = []
    def compile_thread():
        if pin:
            pin_openmp_team()
        before = tids()
        torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
        # counted while this thread lives: its OpenMP team ends with it
        started.append(len(tids() - before))
    thread = threading.Thread(target=compile_thread)
    thread.start()
    thread.join()
    print(pin, started[0])
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2,
                    reason="counts Linux threads of a multi-core OpenMP team")
def test_pinning_the_compile_thread_starts_no_second_openmp_team():
    """Note [OpenMP team of the compile thread], in a fresh process (what oneDNN does
    depends on what ran first): after a 2-thread start and a switch to one thread, oneDNN
    on an unpinned thread starts a team of its own; pinned, it starts none."""
    result = subprocess.run([sys.executable, "-c", _TEAM_SCRIPT], capture_output=True,
                            text=True, timeout=120, check=True)
    left = dict(line.split() for line in result.stdout.splitlines())
    assert left["False"] != "0", result.stdout    # the problem is real here
    assert left["True"] == "0", result.stdout     # and the pin prevents it


def test_explain_shows_where_each_gemm_went(capsys):
    """`dynvm explain` prints the kernel header, whose notes say per GEMM whether it went
    to oneDNN (with both timings) or stayed on torch (Note [CPU fusion])."""

    assert main(["explain", "branchy", "--shape", "batch=2"]) == 0
    out = capsys.readouterr().out
    placed = re.findall(r"# \d+: LINEAR.*?(-> oneDNN linear.*vs torch: M=2 |stays on torch)",
                        out)
    # branchy's two linears, in every artifact explain printed (a demotion re-plans)
    assert len(placed) >= 2 and len(placed) % 2 == 0, out
