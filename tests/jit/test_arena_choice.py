"""Note [Arena by measurement]: an op writes into the arena only where its out= form
measured faster on this device; the choice is the calibrator's, cached, and what the
generated code does."""

from __future__ import annotations

import torch

import dynvm
from dynvm.jit.backends.cpu.arena_choice import ALLOCATE, OUT, out_form_pays
from dynvm.jit.backends.cpu.arena_layout import OUT_KERNELS
from dynvm.jit.calibration import Calibrator, calibrator_for
from tests.jit._jit_helpers import compiled, demo, eager_config, torch_threads


def test_each_planned_op_follows_its_calibrated_choice():
    program = compiled("recommender")
    dm = demo("recommender")
    runtime = dynvm.Runtime(program, jit=eager_config(arena_ops="measured"))
    with torch_threads(1), torch.inference_mode():
        for _ in range(2):
            torch.testing.assert_close(runtime(*dm.example_inputs),
                                       dm.module(*dm.example_inputs), rtol=1e-4, atol=1e-5)
    # op name -> the choices of its size classes (the recommender's LINEARs differ)
    choices: dict[str, set] = {}
    for (op, _), choice in calibrator_for("cpu").entries().items():
        if op.startswith("arena:"):
            assert set(choice.seconds) == {ALLOCATE, OUT} and choice.default == ALLOCATE
            assert all(s > 0 for s in choice.seconds.values())
            choices.setdefault(op.removeprefix("arena:"), set()).add(choice.name)
    assert choices, "no op was calibrated"
    (artifact,) = runtime.jit.artifacts.values()
    into = [line for line in artifact.source.splitlines() if "# into the arena" in line]
    # an op is written into the arena only if a size class of it calibrated as "out"
    for line in into:
        name = line.split("= ")[1].split("_out")[0]
        assert name in OUT_KERNELS and OUT in choices[name], line
    runtime.close()


def test_the_choice_is_measured_once_per_size_class():
    calibrator = Calibrator("cpu", rounds=3)
    form = OUT_KERNELS["ADD"]
    made = []

    def operands():
        made.append(1)
        return [torch.zeros(64, 64), torch.zeros(64, 64)]

    meta = [torch.empty(64, 64, device="meta"), torch.empty(64, 64, device="meta")]
    result = torch.empty(64, 64, device="meta")
    first = out_form_pays("ADD", form, meta, result, operands, torch.device("cpu"),
                          calibrator)
    again = out_form_pays("ADD", form, meta, result, operands, torch.device("cpu"),
                          calibrator)
    assert first == again and made == [1] and calibrator.measurements == 1
    (choice,) = calibrator.entries().values()
    assert choice.name == (OUT if first else ALLOCATE)


class _TwoLinears(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(16, 16)
        self.second = torch.nn.Linear(16, 16)

    def forward(self, x):                       # x: [rows, 16]
        return self.second(self.first(x))       # first's result: an arena candidate


def _family_kernel_source(calibrator) -> str:
    """The CPU kernel of `_TwoLinears` for the family of 8..400 rows, with an arena whose
    ops are chosen by `calibrator`."""
    from torch.export import Dim

    from dynvm.arena import ArenaPool
    from dynvm.jit.backends.cpu.codegen import CpuOptions, compile_kernel
    from dynvm.jit.specialize import specialize

    program = dynvm.compile(_TwoLinears().eval(), (torch.randn(5, 16),),
                            ({0: Dim("rows", min=2, max=4096)},))
    region = program.regions[0]
    reg = region.live_in[0].index
    probes = [{reg: torch.empty(m, 16, device="meta")} for m in (400, 8, 9)]
    spec = specialize(program, region, probes[0], tuple(probes[1:]))
    options = CpuOptions(ArenaPool("cpu", 1 << 24), fusion="off", arena_ops="measured",
                         calibrator=calibrator)
    constants = [t.detach() for t in program.constants]
    return compile_kernel(spec, program, constants, torch.device("cpu"), "test", "family",
                          options).source


def test_a_family_op_goes_to_the_arena_only_where_out_pays_at_both_ends_of_its_sizes():
    from tests.jit._scripted_calibrator import ScriptedCalibrator

    # out= wins for results of 4096 elements or more (the upper bound, 400 x 16 = 6400),
    # loses below (the lower bound, 8 x 16): the family's smaller members would pay
    def big_only(op, key):
        wins = key[1] >= 12
        return {ALLOCATE: 1.0, OUT: 0.5 if wins else 2.0}
    calibrator = ScriptedCalibrator(big_only)
    source = _family_kernel_source(calibrator)
    assert "# into the arena" not in source
    asked = {key[1] for op, key in calibrator.asked if op.startswith("arena:")}
    assert 12 in asked and 7 in asked          # both ends: 6400 and 128 elements
    # out= winning at both ends: planned
    everywhere = ScriptedCalibrator(lambda op, key: {ALLOCATE: 1.0, OUT: 0.5})
    assert "# into the arena" in _family_kernel_source(everywhere)
