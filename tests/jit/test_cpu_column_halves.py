"""A GEMM at a few rows as two column halves with a helper thread (Note [Column halves
with a helper thread] in jit/backends/cpu/column_halves.py): what the halves compute
equals eager and the team (the linear's ordinary primitive) over random shape
sequences, offset and strided inputs, fp32 and bf16, with the helper claiming or never
claiming, with two threads on one kernel, and nothing changes where the library is
absent. The halves-or-team choice is checked on given timings, never on the clock.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import column_halves, helper_libraries, onednn_api
from dynvm.jit.backends.cpu.onednn_conv import eltwise_of
from dynvm.jit.backends.cpu.onednn_linear import LinearSpec, LinearWeights, PrimitiveLinear
from dynvm.jit.backends.cpu.precision import precision_available
from dynvm.jit.backends.cpu.prepack import PrepackCache
from tests.jit import _jit_helpers as h
from tests.jit._onednn import NEEDS_ONEDNN_LIBRARY, bound_native

pytestmark = NEEDS_ONEDNN_LIBRARY
TOL = {"rtol": 1e-4, "atol": 1e-4}
BF16_RELATIVE = 3e-2        # tests/jit/test_cpu_precision.py's bf16 bound



@pytest.fixture(autouse=True)
def _two_threads():
    """The halves run where torch was asked for two threads or more (a test before may
    have left one: Note [Column halves where the team's wake is the cost])."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    yield
    torch.set_num_threads(threads)

def _native():
    """The halves library bound to the loaded libdnnl (tests.jit._onednn.bound_native)."""
    return bound_native(column_halves)


class Block(nn.Module):
    """An encoder layer's GEMMs: QKV-like, an up projection with GELU, a down projection
    added to its input (the residual add a binary post-op), and a head too narrow to
    halve."""

    def __init__(self, d: int = 64, f: int = 256) -> None:
        super().__init__()
        self.qkv, self.up, self.down = nn.Linear(d, 3 * d), nn.Linear(d, f), nn.Linear(f, d)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 8)

    def forward(self, x):                                         # x: [batch, seq, d]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        y = self.norm(x + q * k + v)
        z = self.down(torch.nn.functional.gelu(self.up(y))) + y
        return z, self.head(z)


def _program():
    torch.manual_seed(0)
    model = Block().eval()
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=64)
    return model, dynvm.compile(model, (torch.randn(2, 5, 64),), ({0: batch, 1: seq},))


def _inputs(gen, steps: int = 9):
    """Random (batch, seq) inputs of at most 64 rows: contiguous, offset, strided."""
    for step in range(steps):
        batch = int(torch.randint(1, 4, (1,), generator=gen))
        seq = int(torch.randint(2, 64 // batch + 1, (1,), generator=gen))
        if step % 3 == 0:
            yield torch.randn(batch, seq, 64, generator=gen)
        elif step % 3 == 1:     # offset: a view starting past its storage's first element
            yield torch.randn(batch + 1, seq, 64, generator=gen)[1:]
        else:                   # strided: every other feature of a wider tensor
            yield torch.randn(batch, seq, 128, generator=gen)[..., ::2]


def _runtime(program, halves: str, precision: str = "fp32"):
    rt = dynvm.Runtime(program, jit=h.eager_config(cpu_fusion="always", precision=precision))
    rt.jit._cpu_options = dataclasses.replace(rt.jit._cpu_options, column_halves=halves)
    return rt


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_halves_agree_with_eager_and_the_team(precision):
    if precision_available(precision) is not None:
        pytest.skip(str(precision_available(precision)))
    native = _native()
    model, program = _program()
    gen = torch.Generator().manual_seed(3)
    before_helper, before_caller = native.counts()
    with _runtime(program, "always", precision) as rt, \
            _runtime(program, "never", precision) as team, torch.no_grad():
        for step, x in enumerate(_inputs(gen)):
            before = x.clone()
            rt(x), team(x)        # promoted here (compiled synchronously), run next call
            got, wanted = rt(x), team(x)
            for g, w, e in zip(got, wanted, model(x)):
                if precision == "fp32":
                    torch.testing.assert_close(g, e, **TOL, msg=f"step {step}")
                    torch.testing.assert_close(g, w, **TOL, msg=f"step {step}")
                else:
                    scale = e.abs().max()
                    assert (g - e).abs().max() <= BF16_RELATIVE * scale, step
                    assert (g - w).abs().max() <= 1e-3 * scale, step
            assert torch.equal(x, before)      # the caller's tensor is never written
        sources = [a.source for a in rt.jit.artifacts.values()]
        assert not rt.stats()["compile_failures"]
    assert sources
    for source in sources:
        # qkv, up and down as halves; the 8-column head too narrow
        assert "3 as column halves with a helper thread" in source, source
        assert "no halves: 8 columns" in source, source
        assert ".enter()" in source
    after_helper, after_caller = native.counts()
    assert after_helper + after_caller >= before_helper + before_caller + 3 * 9


def test_a_returned_result_is_unchanged_by_the_next_call():
    _native()
    _, program = _program()
    gen = torch.Generator().manual_seed(4)
    with _runtime(program, "always") as rt, torch.no_grad():
        x = torch.randn(1, 16, 64, generator=gen)
        rt(x)
        first = rt(x)
        kept = [t.clone() for t in first]
        for _ in range(3):
            rt(torch.randn(1, 16, 64, generator=gen))
        for t, k in zip(first, kept):
            assert torch.equal(t, k)


def test_a_helper_that_never_claims_leaves_the_caller_every_piece():
    native = _native()
    model, program = _program()
    gen = torch.Generator().manual_seed(5)
    native.set_claiming(0)
    try:
        with _runtime(program, "always") as rt, torch.no_grad():
            x = torch.randn(1, 32, 64, generator=gen)
            rt(x)
            helper, caller = native.counts()
            for _ in range(5):
                for g, e in zip(rt(x), model(x)):
                    torch.testing.assert_close(g, e, **TOL)
            after_helper, after_caller = native.counts()
    finally:
        native.set_claiming(1)
    pieces = sum(len(column_halves.pieces_of(n)) for n in (192, 256, 64))  # qkv, up, down
    assert after_helper == helper
    assert after_caller == caller + 5 * pieces


def test_pieces_cover_the_columns_in_blocks():
    for columns in (32, 48, 64, 96, 100, 192, 768, 2304, 3072):
        pieces = column_halves.pieces_of(columns)
        assert 2 <= len(pieces) <= column_halves.PIECES, (columns, pieces)
        assert [f for f, _ in pieces] == [0] + list(itertools.accumulate(
            w for _, w in pieces[:-1])), pieces
        assert sum(w for _, w in pieces) == columns
        assert all(w % 16 == 0 for _, w in pieces[:-1]), pieces
    assert column_halves.pieces_of(16) == column_halves.pieces_of(8) == []


def test_the_helpers_counters_add_up():
    # Every piece of every halves call is counted once, by the helper or the caller, in
    # the process's counters, the per-call counts and the kernel's own; waits and claims
    # move only with pieces the helper ran.
    native = _native()
    team, halves = _halved(native, 16, "add")
    kernel = column_halves.KernelHalves(native, force=True)
    gen = torch.Generator().manual_seed(10)
    x, o = torch.randn(16, 48, generator=gen), torch.randn(16, 96, generator=gen)
    for claiming in (0, 1):
        native.set_claiming(claiming)
        try:
            before = native.stats()
            for _ in range(6):
                token = kernel.enter()
                try:
                    for _ in range(4):
                        assert torch.equal(halves(x, o), team(x, o))
                finally:
                    kernel.leave(token)
            after = native.stats()
        finally:
            native.set_claiming(1)
        ran = (after.by_helper - before.by_helper) + (after.by_caller - before.by_caller)
        assert ran == 6 * 4 * halves.pieces
        assert after.wakes - before.wakes <= 6
        assert after.wait_ns >= before.wait_ns and after.wake_ns >= before.wake_ns
        if not claiming:
            assert after.by_helper == before.by_helper
            assert (after.wait_ns, after.sleeps, after.claim_ns) == (
                before.wait_ns, before.sleeps, before.claim_ns)
    assert sum(kernel.b_halves.values()) == 2 * 6 * 4 * halves.pieces


def test_where_the_library_is_absent_kernels_keep_the_team(monkeypatch):
    model, program = _program()
    missing = Path("/nonexistent/_column_halves.so")
    bound, why = column_halves.native(onednn_api.library(), missing)
    assert bound is None and "was not built" in why
    monkeypatch.setattr(helper_libraries, "find_extension", lambda stem: missing)
    gen = torch.Generator().manual_seed(6)
    with _runtime(program, "on") as rt, torch.no_grad():
        for x in _inputs(gen, 3):
            rt(x)
            for g, e in zip(rt(x), model(x)):
                torch.testing.assert_close(g, e, **TOL)
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources and all("no column halves (_column_halves was not built" in s
                           and ".enter()" not in s for s in sources), sources


def _halved(native, rows: int, binary: str | None):
    library = onednn_api.library()
    torch.manual_seed(7)
    weight, bias = torch.randn(96, 48) / 7, torch.randn(96)
    spec = LinearSpec(48, 96, torch.float32, True, eltwise_of("gelu", [], "none"), binary)
    team = PrimitiveLinear(library, spec, LinearWeights(library, weight), bias, [rows],
                           ("gelu", [], "none"))
    halves = column_halves.halves_of(team, library, native, rows, lambda: weight,
                                     PrepackCache(), (0, "onednn-linear", False,
                                                      torch.float32), bias)
    return team, halves


def test_two_threads_on_one_kernel():
    # The first call to enter owns the helper; a second thread's call is refused and
    # runs the team; both compute the same results throughout.
    native = _native()
    team, halves = _halved(native, 24, "mul")
    kernel = column_halves.KernelHalves(native, force=True)
    gen = torch.Generator().manual_seed(8)
    xs = [torch.randn(2, 12, 48, generator=gen) for _ in range(4)]
    others = [torch.randn(2, 12, 96, generator=gen) for _ in range(4)]
    wanted = [team(x, o) for x, o in zip(xs, others)]
    owner = kernel.enter()
    assert owner is not None and owner[0]
    refused = []
    errors = []

    def second():
        try:
            token = kernel.enter()
            refused.append(token is None)
            for _ in range(20):
                for x, o, w in zip(xs, others, wanted):
                    assert torch.equal(halves(x, o), w)
            kernel.leave(token)
        except BaseException as exc:     # reported below, in the test's thread
            errors.append(exc)

    thread = threading.Thread(target=second)
    thread.start()
    for _ in range(20):
        for x, o, w in zip(xs, others, wanted):
            assert torch.equal(halves(x, o), w)
    thread.join()
    kernel.leave(owner)
    assert not errors, errors
    assert refused == [True]


def test_halves_of_a_strided_and_offset_input_equal_the_team():
    native = _native()
    team, halves = _halved(native, 16, "add")
    kernel = column_halves.KernelHalves(native, force=True)
    gen = torch.Generator().manual_seed(9)
    for x, o in ((torch.randn(17, 48, generator=gen)[1:], torch.randn(16, 96, generator=gen)),
                 (torch.randn(16, 96, generator=gen)[:, ::2],
                  torch.randn(16, 192, generator=gen)[:, 1::2])):
        token = kernel.enter()
        try:
            got = halves(x, o)
        finally:
            kernel.leave(token)
        assert torch.equal(got, team(x, o))


def test_a_compile_workers_runs_keep_the_team_and_are_not_timed():
    # Calibration and probation run kernels on the compile worker: the helper stays with
    # the serving calls (a worker's halves took it from them and raised it beside them)
    # and the choice times serving calls only.
    from dynvm.jit import background

    native = _native()
    team, halves = _halved(native, 16, None)
    kernel = column_halves.KernelHalves(native)
    x = torch.randn(16, 48, generator=torch.Generator().manual_seed(11))
    seen = []

    def worker():
        background.background_thread()
        token = kernel.enter()
        seen.append((token, torch.equal(halves(x, None), team(x, None)),
                     native.stats().by_helper + native.stats().by_caller))
        kernel.leave(token)
        seen.append(native.stats().by_helper + native.stats().by_caller)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    (token, equal, ran_before), ran_after = seen
    assert token is None and equal and ran_after == ran_before
    assert kernel.choice.runs == {True: 0, False: 0}
    token = kernel.enter()           # a serving thread's call: the choice's first, halves
    assert token is not None and token[0]
    kernel.leave(token)
    assert kernel.choice.runs == {True: 1, False: 0}


def test_one_thread_asked_for_runs_the_team_untimed():
    # Note [Column halves where the team's wake is the cost]: no helper beside a
    # process that asked torch for one thread
    native = _native()
    kernel = column_halves.KernelHalves(native, force=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert kernel.enter() is None
    finally:
        torch.set_num_threads(threads)
    assert kernel.choice.runs == {True: 0, False: 0}
    if threads >= 2:
        token = kernel.enter()
        assert token is not None and token[0]
        kernel.leave(token)


def test_a_linear_past_max_rows_gets_halves_only_when_small():
    # Note [Column halves where the team's wake is the cost]: the held-out encoder's
    # linears at 128 rows (at most 2^25 multiply-adds) gained; BERT-base's did not
    rows = column_halves.MAX_ROWS
    assert column_halves.takes(rows, 768, 3072)                 # any weight up to MAX_ROWS
    assert column_halves.takes(128, 256, 1024) and column_halves.takes(128, 256, 768)
    assert not column_halves.takes(128, 768, 768)
    assert not column_halves.takes(4096, 256, 256)


def test_a_call_beside_a_compile_workers_task_is_no_timing():
    # Note [Halves chosen in rounds]: the worker had the other core
    from dynvm.jit import background

    kernel = column_halves.KernelHalves(_native(), force=False)
    with background.worker_task():
        kernel.leave(kernel.enter())
    assert kernel.choice.runs == {True: 0, False: 1}
    assert kernel.choice._samples == {True: [], False: []}
    kernel.leave(kernel.enter())
    assert kernel.choice._samples[False] and not kernel.choice._samples[True]


def test_the_config_turns_them_off_and_refuses_other_values():
    import dynvm
    from dynvm.vm.errors import ConfigError

    model, program = _program()
    with dynvm.Runtime(program, jit=dynvm.JitConfig(cpu_column_halves="off")) as rt:
        assert rt.jit._cpu_options.column_halves == "off"
    with dynvm.Runtime(program, jit=dynvm.JitConfig()) as rt:
        assert rt.jit._cpu_options.column_halves == "on"
    with pytest.raises(ConfigError, match="cpu_column_halves"):
        dynvm.JitConfig(cpu_column_halves="always")


class _ConvHead(nn.Module):
    """A convolution and a linear head: a kernel whose time is its convolution."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(3, 16, 3, padding=1), nn.Linear(16, 64)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).mean((2, 3)))


def test_a_kernel_with_convolutions_keeps_the_team_for_its_linears():
    # Note [Column halves where the team's wake is the cost]: its last paragraph
    torch.manual_seed(0)
    model = _ConvHead().eval()
    program = dynvm.compile(model, (torch.randn(2, 3, 8, 8),),
                            ({0: Dim("batch", min=1, max=8)},))
    with _runtime(program, "always") as rt, torch.no_grad():
        x = torch.randn(2, 3, 8, 8)
        rt(x)
        torch.testing.assert_close(rt(x), model(x), **TOL)
        sources = [a.source for a in rt.jit.artifacts.values()]
    assert sources and all("a kernel with convolutions" in s and ".enter()" not in s
                           for s in sources), sources
