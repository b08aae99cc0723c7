"""Note [Arena by measurement]: an op writes into the arena only where its out= form
measured faster on this device; the choice is the calibrator's, cached, and what the
generated code does."""

from __future__ import annotations

import torch

import dynvm
from dynvm.jit.backends.cpu_arena import OUT_KERNELS
from dynvm.jit.backends.cpu_arena_choice import ALLOCATE, OUT, out_form_pays
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
    choices = {op.removeprefix("arena:"): c for (op, _), c in
               calibrator_for("cpu").entries().items() if op.startswith("arena:")}
    assert choices, "no op was calibrated"
    for choice in choices.values():
        assert set(choice.seconds) == {ALLOCATE, OUT} and choice.default == ALLOCATE
        assert all(s > 0 for s in choice.seconds.values())
    (artifact,) = runtime.jit.artifacts.values()
    into = [line for line in artifact.source.splitlines() if "# into the arena" in line]
    # an op calibrated as "out" is written into the arena; one calibrated "allocate" not
    for line in into:
        name = line.split("= ")[1].split("_out")[0]
        assert name in OUT_KERNELS and choices[name].name == OUT, line
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
