"""Abstract evaluation knows every register's shape, dtype and strides: checked against
the registers of a real interpreted run of each demo model's regions."""

from __future__ import annotations

import random

import pytest
import torch

import dynvm
from dynvm.models import REGISTRY, get
from dynvm.vm.abstract import evaluate_region
from dynvm.vm.interpreter import Interpreter


def _real_registers(interpreter: Interpreter, inputs) -> list[dict[int, object]]:
    """Run region by region (straight-line programs: one region) recording registers."""
    regs = interpreter._template.copy()
    regs[: len(inputs)] = inputs
    snapshots = []
    for region in interpreter.program.regions:
        live_in = {r.index: regs[r.index] for r in region.live_in}
        values = {}
        for step, instr in zip(interpreter.region_steps(region.index),
                               interpreter.program.code[region.start:region.stop]):
            step(regs)
            for dst in instr.dsts:
                values[dst.index] = regs[dst.index]
        snapshots.append((region, live_in, values))
        break  # later regions may depend on branches; region 0 covers straight-line code
    return snapshots


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_abstract_shapes_match_real_registers(name):
    demo = get(name)
    program = dynvm.compile(demo.module, demo.example_inputs, demo.dynamic_shapes, name=name)
    interpreter = Interpreter(program)
    rng = random.Random(7)
    for _ in range(3):
        inputs = demo.sample_inputs(rng)
        with torch.inference_mode():
            for region, live_in, real in _real_registers(interpreter, inputs):
                abstract = evaluate_region(program, region, live_in)
                assert real, "region wrote no register"
                for index, value in real.items():
                    got = abstract[index]
                    if isinstance(value, torch.Tensor):
                        assert got.shape == value.shape, f"%{index}"
                        assert got.dtype == value.dtype, f"%{index}"
                        assert got.stride() == value.stride(), f"%{index}"
                    elif value is not None:
                        assert got == value, f"%{index}"
