"""Note [oneDNN at a new row count]: a family kernel whose GEMM rows vary runs oneDNN
only in the size classes of M where it measured faster, only for an M seen often enough
to pay back oneDNN's primitive build, and never on an M it was not measured for; the
verdict rule itself; and that the calibration really times oneDNN at a new M per call.

The calibrator here is scripted (tests/jit/_scripted_calibrator.py): it answers each
question from a table by size class, so the rule is tested without the host's timing
noise, after running every candidate once (the real forms on real operands)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.export import Dim

import dynvm
from dynvm.jit.backends.cpu import fusion as cpu_fusion
from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
from dynvm.jit.backends.cpu.fusion import onednn_available
from dynvm.jit.backends.cpu.prepack import PrepackCache
from dynvm.jit.backends.cpu.row_gate import (
    MAX_SIGHTINGS,
    ONEDNN,
    ONEDNN_NEW_ROWS,
    TORCH,
    RowGate,
    UnaryRowGate,
    sightings_before_onednn,
)
from dynvm.jit.calibration import Calibrator, Choice, size_class
from dynvm.jit.specialize import specialize
from tests.jit._kernel_run import run_kernel
from tests.jit._scripted_calibrator import ScriptedCalibrator

pytestmark = pytest.mark.skipif(not onednn_available(torch.device("cpu")),
                                reason="this torch build has no oneDNN")
TOL = {"rtol": 1e-4, "atol": 1e-4}
D = 64


def _choice(**seconds) -> Choice:
    seconds = {name.replace("_", " "): s for name, s in seconds.items()}
    return Choice(min(seconds, key=seconds.__getitem__), seconds, TORCH)


@pytest.mark.parametrize(("torch_s", "warm", "fresh", "verdict"), [
    (1.0, 0.99, 0.99, None),          # within the margin: torch
    (1.0, 1.5, 9.0, None),            # oneDNN slower even warm: torch
    (1.0, 0.5, 0.9, 0),               # faster even when it builds a primitive: always
    (1.0, 0.5, 1.04, 0),              # its build costs less than the margin: always
    (1.0, 0.5, 2.0, 2),               # build pays back after 2 calls at one M
    (1.0, 0.75, 6.0, 20),             # (6 - 1) / (1 - 0.75) calls
    (1.0, 0.875, 9.0, 64),            # 64 calls: MAX_SIGHTINGS, still gated
    (1.0, 0.875, 10.0, None),         # 72 calls > MAX_SIGHTINGS: not worth a gate
])
def test_sightings_before_onednn(torch_s, warm, fresh, verdict):
    choice = _choice(torch=torch_s, onednn=warm, onednn_new_rows=fresh)
    assert sightings_before_onednn(choice, margin=0.05) == verdict
    assert MAX_SIGHTINGS == 64


def test_the_build_is_judged_on_each_forms_fastest_sample():
    # medians with one slow new-M sample in three would gate; the fastest samples say
    # the build costs less than the margin over torch
    noisy = Choice(ONEDNN, {TORCH: 1.0, ONEDNN: 0.5, ONEDNN_NEW_ROWS: 9.0}, TORCH,
                   {TORCH: 0.875, ONEDNN: 0.5, ONEDNN_NEW_ROWS: 0.75})
    assert sightings_before_onednn(noisy, margin=0.05) == 0
    # whether oneDNN wins at all stays the medians' call
    losing = Choice(TORCH, {TORCH: 1.0, ONEDNN: 1.0, ONEDNN_NEW_ROWS: 9.0}, TORCH,
                    {TORCH: 1.0, ONEDNN: 0.5, ONEDNN_NEW_ROWS: 0.5})
    assert sightings_before_onednn(losing, margin=0.05) is None


def test_the_gate_counts_sightings_per_m_and_answers_per_size_class():
    ran = []
    gate = UnaryRowGate((None, None, None, 2, 0),
                        lambda x, *fused_operands: ran.append(("onednn", len(x))),
                        lambda x: ran.append(("torch", len(x))))

    def run(m):
        ran.clear()
        gate(torch.empty(m, 3), "packed", None, "none", [], "")
        return ran[0][0]
    # class 3 (M 8..15): torch for the first two sightings of each M, then oneDNN
    assert [run(9) for _ in range(4)] == ["torch", "torch", "onednn", "onednn"]
    assert run(10) == "torch" and not gate.uses_onednn(10)
    # class 4 (M 16..31) says 0: oneDNN at once; above the table its last entry answers
    assert run(17) == "onednn" and run(1000) == "onednn"
    # below the measured classes: never, however often seen
    assert all(run(5) == "torch" for _ in range(100))
    assert gate.seen.get(5) is None        # nothing counted where oneDNN never runs


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, D)
        self.down = nn.Linear(D, 16)

    def forward(self, x):                       # x: [rows, D]
        return self.down(torch.relu(self.up(x)))


@functools.lru_cache(maxsize=1)
def _program():
    model = _Mlp().eval()
    rows = Dim("rows", min=2, max=4096)
    return model, dynvm.compile(model, (torch.randn(5, D),), ({0: rows},))


def _family_kernel(low: int, high: int, calibrator: Calibrator):
    """The CPU kernel of the MLP for the family of row counts low..high (probes at
    the bounds and low + 1, Note [Probes])."""
    _, program = _program()
    region = program.regions[0]
    reg = region.live_in[0].index
    probes = [{reg: torch.empty(m, D, device="meta")} for m in (high, low, low + 1)]
    spec = specialize(program, region, probes[0], tuple(probes[1:]))
    constants = [t.detach() for t in program.constants]
    options = CpuOptions(None, fusion="measured", calibrator=calibrator,
                         prepacked=PrepackCache())
    kernel = compile_kernel(spec, program, constants, torch.device("cpu"), "test",
                            "family", options)
    return kernel, region


def _spy_gates(kernel) -> tuple[list[RowGate], list[int]]:
    """The kernel's gates, their oneDNN calls recorded (the M of each)."""
    gates = [v for v in kernel.fn.__globals__.values() if isinstance(v, RowGate)]
    onednn_rows: list[int] = []
    for gate in gates:
        real = gate.fused

        def recording(x, *args, real=real):
            onednn_rows.append(x.numel() // x.shape[-1])
            return real(x, *args)
        gate.fused = recording
    return gates, onednn_rows


def _by_size_class(table):
    """A calibrator answering GEMM questions with `table(size class) -> (torch, oneDNN,
    oneDNN at a new M)` seconds; any other question (there are none with the arena off)
    keeps its default."""
    def script(op, key):
        if not op.startswith("onednn"):
            return {}
        return dict(zip((TORCH, ONEDNN, ONEDNN_NEW_ROWS), table(key[0])))
    return ScriptedCalibrator(script)


def _loses_below_32(c: int):
    # M < 32: oneDNN slower even warm; M >= 32: faster warm, its build pays after 2 calls
    return (1.0, 2.0, 10.0) if c < 5 else (1.0, 0.5, 2.0)


def test_a_family_kernel_never_runs_onednn_where_it_lost_or_was_not_measured():
    model, _ = _program()
    calibrator = _by_size_class(_loses_below_32)
    kernel, region = _family_kernel(8, 100, calibrator)
    # measured at every size class the family's rows cover; the build (oneDNN at a new
    # M) only where oneDNN won
    asked = [(op, key) for op, key in calibrator.asked if op.startswith("onednn")]
    assert {key[0] for op, key in asked if "at new M" not in op} >= {3, 4, 5, 6}
    gemm_questions = [(op, key) for op, key in asked if "at new M" in op]
    assert {key[0] for _, key in gemm_questions} == {5, 6}
    assert "row-gated" in kernel.source and "= row_gate" in kernel.source
    gates, onednn_rows = _spy_gates(kernel)
    assert gates
    gen = torch.Generator().manual_seed(0)
    sequence = [8, 9, 31, 31, 31, 31, 32, 40, 40, 40, 40, 64, 100, 100, 100, 17, 17, 17]
    for m in sequence:
        x = torch.randn(m, D, generator=gen)
        with torch.no_grad():
            torch.testing.assert_close(run_kernel(kernel, region, x), model(x), **TOL,
                                       msg=f"rows {m}")
    measured_winners = {key[0] for _, key in gemm_questions if key[0] >= 5}
    assert onednn_rows, "oneDNN never ran where it measured faster"
    assert all(size_class(m) in measured_winners or m > 64 for m in onednn_rows)
    assert all(m >= 32 for m in onednn_rows)
    # each M reached oneDNN only on its third sighting or later (two calls on torch)
    per_gate = len(gates)
    assert sorted(set(onednn_rows)) == [40, 100]
    assert onednn_rows.count(40) == 2 * per_gate and onednn_rows.count(100) == per_gate


def test_all_classes_winning_at_a_new_m_fuse_without_a_gate_and_all_losing_stay_on_torch():
    always = _by_size_class(lambda c: (1.0, 0.5, 0.8))
    kernel, _ = _family_kernel(8, 100, always)
    assert "onednn_linear" in kernel.source and "gated" not in kernel.source
    never = _by_size_class(lambda c: (1.0, 0.9, 50.0))
    kernel, _ = _family_kernel(8, 100, never)
    assert "onednn" not in kernel.source
    assert any("no faster here at the family's row counts" in n for n in kernel.notes)


def test_one_row_count_is_asked_once_without_the_new_m_form():
    calibrator = _by_size_class(_loses_below_32)
    _, program = _program()
    region = program.regions[0]
    x = torch.randn(40, D)
    spec = specialize(program, region, {region.live_in[0].index: x})
    constants = [t.detach() for t in program.constants]
    kernel = compile_kernel(spec, program, constants, torch.device("cpu"), "test", "strong",
                            CpuOptions(None, fusion="measured", calibrator=calibrator))
    assert calibrator.asked and not any("at new M" in op for op, _ in calibrator.asked)
    assert "onednn_linear" in kernel.source and "gated" not in kernel.source


def test_the_new_m_form_runs_at_a_new_row_count_on_every_call(monkeypatch):
    rows: list[int] = []
    real = cpu_fusion.FUSED_KERNELS[cpu_fusion.LINEAR_UNARY]

    def recording(x, *args):
        rows.append(x.shape[0])
        return real(x, *args)
    monkeypatch.setitem(cpu_fusion.FUSED_KERNELS, cpu_fusion.LINEAR_UNARY, recording)

    class _Once(ScriptedCalibrator):
        def choose(self, op, size_class_key, candidates):
            forms = candidates()
            rows.clear()
            if ONEDNN_NEW_ROWS in forms:
                for _ in range(5):
                    forms[ONEDNN_NEW_ROWS]()
                self.new_rows = list(rows)
            rows.clear()
            for _ in range(3):
                forms[ONEDNN]()
            self.repeated = list(rows)
            return super().choose(op, size_class_key, forms)

    calibrator = _Once(_by_size_class(_loses_below_32).script)
    _family_kernel(40, 60, calibrator)
    assert len(set(calibrator.new_rows)) == 5 and min(calibrator.new_rows) > 32
    assert len(set(calibrator.repeated)) == 1
