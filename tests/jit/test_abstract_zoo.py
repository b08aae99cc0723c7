"""Abstract evaluation equals execution on every zoo model (docs/ARCHITECTURE.md, Invariants): each
entry's program, at its first held-out shape, register by register
(tests/jit/_abstract_check.py). Each export is the zoo's own, made once per process
(tests/zoo/_zoo_harness.compiled) and shared with tests/zoo."""

from __future__ import annotations

import pytest

import dynvm
from tests.jit._abstract_check import check_program
from tests.jit._jit_helpers import torch_threads

zoo = pytest.importorskip("tests.zoo._zoo")
harness = pytest.importorskip("tests.zoo._zoo_harness")


@pytest.mark.slow
@pytest.mark.parametrize("name", [entry.name for entry in zoo.entries()])
def test_zoo_model_abstract_matches_real(name):
    compiled = harness.compiled(name)
    point = compiled.entry.held_out[0]
    runtime = dynvm.Runtime(compiled.program, jit=False)
    with torch_threads(1):
        found = check_program(runtime, *compiled.built.make_inputs(point, 1))
    assert found == [], "\n".join(found[:10])
