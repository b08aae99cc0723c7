"""The model zoo against eager PyTorch: every entry, exported with its dynamic dims,
through dynvm.compile -> save -> load -> Runtime, on its held-out shapes, in the
interpreter and in the JIT with promotion forced (Notes [Zoo tolerance] and
[Zoo JIT forcing] in _zoo_harness)."""

from __future__ import annotations

import pytest
import torch

import dynvm
from tests.zoo import _zoo_harness as harness
from tests.zoo._zoo import entries

ENTRIES = {entry.name: entry for entry in entries()}
LIBRARIES = {"transformers", "torchvision", "timm", "torch_geometric"}


@pytest.fixture(scope="session")
def zoo_program():
    """compile_entry(name), once per process for every zoo test (harness.compiled)."""
    return harness.compiled


def test_zoo_covers_the_libraries():
    assert len(ENTRIES) >= 30
    assert {entry.library for entry in ENTRIES.values()} == LIBRARIES


def _points(entry):
    # Seeds differ per point and from the export's (0): no input is one the model saw.
    return [(point, 1 + index) for index, point in enumerate(entry.held_out)]


@pytest.mark.parametrize("name", ENTRIES)
def test_interpreter_matches_eager(zoo_program, name):
    compiled = zoo_program(name)
    with dynvm.Runtime(compiled.program, jit=False) as runtime:
        for point, seed in _points(compiled.entry):
            inputs = compiled.built.make_inputs(point, seed)
            expected = harness.eager(compiled.built, inputs)
            harness.assert_matches(compiled.entry, runtime(*inputs), expected,
                                   f"{name} interpreter at {point}")


@pytest.mark.parametrize("name", ENTRIES)
def test_jit_specializes_and_matches_eager(zoo_program, name):
    compiled = zoo_program(name)
    with dynvm.Runtime(compiled.program, jit=harness.jit_config()) as runtime:
        for point, seed in _points(compiled.entry):
            inputs = compiled.built.make_inputs(point, seed)
            expected = harness.eager(compiled.built, inputs)
            harness.assert_matches(compiled.entry, runtime(*inputs), expected,
                                   f"{name} JIT first call at {point}")
            before = runtime.stats()["specialized_region_calls"]
            harness.assert_matches(compiled.entry, runtime(*inputs), expected,
                                   f"{name} JIT second call at {point}")
            stats = runtime.stats()
            assert stats["specialized_region_calls"] > before, \
                f"{name} at {point}: the second call ran no specialized code"
            assert not harness.jit_failures(stats), f"{name} at {point}: " \
                f"{harness.jit_failures(stats)}"
        assert stats["compiles"] >= 1


IMAGE_MODELS = ("resnet", "mobilenet-v3", "vit")


@pytest.mark.parametrize("name", IMAGE_MODELS)
def test_image_models_take_channels_last_images(zoo_program, name):
    """Images sent channels-last (a common pre-processing layout) get eager's answer, in
    the interpreter and the JIT: the programs were exported from NCHW examples, so every
    specialization met here is for another layout than the export's (the layout is in
    the guard; Note [Channels-last chains]); tests/vm/test_view_layouts.py has the head
    whose flatten has no view in that layout."""
    compiled = zoo_program(name)
    with dynvm.Runtime(compiled.program, jit=False) as interpreter, \
            dynvm.Runtime(compiled.program, jit=harness.jit_config()) as jit:
        for point, seed in _points(compiled.entry):
            (image,) = compiled.built.make_inputs(point, seed)
            image = image.contiguous(memory_format=torch.channels_last)
            expected = harness.eager(compiled.built, (image,))
            for runtime, what in ((interpreter, "interpreter"), (jit, "JIT")):
                for call in ("first", "second"):
                    harness.assert_matches(compiled.entry, runtime(image), expected,
                                           f"{name} {what} {call} call, channels-last, "
                                           f"at {point}")
        stats = jit.stats()
        assert stats["specialized_region_calls"] > 0, f"{name}: nothing ran specialized"
        assert not harness.jit_failures(stats), f"{name}: {harness.jit_failures(stats)}"


DERIVED = tuple(name for name, entry in ENTRIES.items() if "kh" in entry.export_point)


def test_six_cnns_declare_a_derived_resolution():
    assert len(DERIVED) >= 6, DERIVED


@pytest.mark.parametrize("name", DERIVED)
def test_derived_resolution_is_kept_and_checked(zoo_program, name):
    """Note [Derived resolution]: the program keeps 32*kh and 32*kw (not a free range),
    and refuses a side off the grid with the expression in the message."""
    compiled = zoo_program(name)
    dims = compiled.program.inputs[0].dims
    assert [(d.name, d.scale, d.offset) for d in dims[2:]] == [("kh", 32, 0), ("kw", 32, 0)]
    with dynvm.Runtime(compiled.program, jit=False) as runtime, \
            pytest.raises(dynvm.ShapeError, match=r"dim 3 must be 32\*kw for kw in"):
        runtime(torch.randn(1, 3, 64, 100))


@pytest.mark.parametrize("name", ("mixtral", "qwen2-moe"))
def test_moe_experts_are_one_custom_op_call(zoo_program, name):
    """Note [Custom ops]: transformers' MoE experts stay the op the model exports, one
    CALL_CUSTOM per layer (the interpreter and JIT tests above run them against eager)."""
    compiled = zoo_program(name)
    calls = [instr for instr in compiled.program.code if instr.op == "CALL_CUSTOM"]
    assert calls, f"{name}: no custom op in the program"
    assert {instr.args[0].value for instr in calls} == \
        {"transformers::grouped_mm_fallback.default"}
