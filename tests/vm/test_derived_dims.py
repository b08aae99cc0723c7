"""Derived dims (Note [Derived dims] in dynvm.vm.input_check): an input dim declared as
`a * Dim(...) + b` is accepted, recorded in the signature, the listing and the .dvm file,
checked with a message that names the expression, and served by the JIT's families
over the root's values (Note [Probes] in dynvm.jit.specialize)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.export import Dim

import dynvm
from dynvm.jit.specialize import on_root_grid
from dynvm.vm.asm import assemble, disassemble
from dynvm.vm.errors import ShapeError
from dynvm.vm.input_check import check_shape
from dynvm.vm.program import DimSpec
from dynvm.vm.sample_inputs import declared_dims, dim_values, random_inputs
from dynvm.vm.verifier import VerifyError, verify
from tests.jit._jit_helpers import eager_config


class _Pooled(torch.nn.Module):
    """Two stride-2 convs and a global pool: needs its side to divide by 4, as a CNN's
    needs it to divide by 32."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.b = torch.nn.Conv2d(4, 6, 3, stride=2, padding=1)

    def forward(self, x):
        return torch.nn.functional.adaptive_avg_pool2d(self.b(self.a(x).relu()), 1).flatten(1)


class _TwoInputs(torch.nn.Module):
    """`y` is half as tall as `x`: their heights share one root at two scales."""

    def forward(self, x, y):
        return x[:, ::2] + y


@pytest.fixture(scope="module")
def pooled():
    torch.manual_seed(0)
    module = _Pooled().eval()
    k, w = Dim("k", min=1, max=6), Dim("w", min=1, max=6)
    program = dynvm.compile(module, (torch.randn(2, 3, 16, 12),),
                            ({0: Dim("batch", min=1, max=4), 2: 8 * k, 3: 4 * w + 4},))
    return module, program


def test_signature_records_the_relation(pooled):
    _, program = pooled
    dims = program.inputs[0].dims
    assert (dims[2].name, dims[2].scale, dims[2].offset) == ("k", 8, 0)
    assert (dims[3].name, dims[3].scale, dims[3].offset) == ("w", 4, 4)
    assert dims[2].root_range() == (2, 6) and (dims[2].low, dims[2].high) == (16, 48)
    assert str(dims[2]) == "8*k:16..48" and str(dims[3]).startswith("4*w+4:")
    assert not dims[0].is_derived and dims[2].is_derived


def test_file_and_listing_round_trip(pooled, tmp_path):
    _, program = pooled
    path = tmp_path / "pooled.dvm"
    dynvm.save(program, path)
    loaded = dynvm.load(path)
    assert loaded.inputs == program.inputs
    assert loaded.content_hash == program.content_hash
    again = assemble(disassemble(program), program.constants)
    assert again.inputs == program.inputs
    assert again.content_hash == program.content_hash


def test_interpreter_matches_eager_off_the_export_shape(pooled):
    module, program = pooled
    with dynvm.Runtime(program, jit=False) as runtime:
        for shape in ((1, 3, 24, 12), (3, 3, 48, 28), (4, 3, 40, 16)):
            x = torch.randn(shape)
            torch.testing.assert_close(runtime(x), module(x), rtol=1e-5, atol=1e-5)


def test_refusal_names_the_expression(pooled):
    _, program = pooled
    with dynvm.Runtime(program, jit=False) as runtime:
        with pytest.raises(ShapeError, match=r"dim 2 must be 8\*k for k in 2\.\.6, got 20"):
            runtime(torch.randn(1, 3, 20, 8))
        with pytest.raises(ShapeError, match=r"dim 3 must be 4\*w\+4 for w in 2\.\.6, got 10"):
            runtime(torch.randn(1, 3, 16, 10))
        with pytest.raises(ShapeError, match=r"dim 2 must be 8\*k for k in 2\.\.6, got 56"):
            runtime(torch.randn(1, 3, 56, 8))


def test_shared_root_at_two_scales():
    module = _TwoInputs()
    k = Dim("k", min=2, max=10)
    program = dynvm.compile(module, (torch.randn(1, 8, 3), torch.randn(1, 4, 3)),
                            ({1: 2 * k}, {1: k}))
    x_dim, y_dim = program.inputs[0].dims[1], program.inputs[1].dims[1]
    assert (x_dim.name, x_dim.scale, y_dim.name, y_dim.scale) == ("k", 2, "k", 1)
    with dynvm.Runtime(program, jit=False) as runtime:
        x, y = torch.randn(1, 12, 3), torch.randn(1, 6, 3)
        torch.testing.assert_close(runtime(x, y), module(x, y))
        with pytest.raises(ShapeError, match=r"dim 1 \(k\) must agree with input 'x' dim 1 "
                                             r"\(2\*k\) on k"):
            runtime(torch.randn(1, 12, 3), torch.randn(1, 5, 3))
    # The root's value, not the size, is what dynvm run and precompile draw.
    assert declared_dims(program) == {"k": (2, 10)}
    drawn = random_inputs(program, {"k": 7}, torch.Generator().manual_seed(0))
    assert [tuple(t.shape) for t in drawn] == [(1, 14, 3), (1, 7, 3)]
    assert dim_values(program, drawn) == {"k": 7}


def test_check_shape_agrees_on_the_root():
    x = ((1, 8, "b"), (32, 160, "k", 32, 0))
    y = ((16, 80, "k", 16, 0),)
    bound: dict = {}
    check_shape("x", (2, 96), x, bound)
    check_shape("y", (48,), y, bound)  # k = 3 in both
    with pytest.raises(ShapeError, match=r"input 'y': dim 0 \(16\*k\) is 64 \(k=4\) but "
                                         r"input 'x' has k=3"):
        check_shape("y", (64,), y, bound)


def test_jit_family_probes_valid_sizes_and_matches_eager(pooled):
    module, program = pooled
    probes = on_root_grid(program, tuple({0: torch.empty(2, 3, h, 8, device="meta")}
                                         for h in (48, 17, 18)))
    heights = [p[0].shape[2] for p in probes]
    # A bucket 17..48 probed at its high end, its low end and the point after: three
    # distinct roots (k = 6, 3, 4), where a plain dim's 17 and 18 would be refused.
    assert heights == [48, 24, 32], heights
    with dynvm.Runtime(program, jit=eager_config(families=True)) as runtime:
        # All in one bucket per dim (batch 2..4, sides 17..64): one family.
        for shape in ((2, 3, 24, 20), (3, 3, 40, 24), (4, 3, 32, 28), (2, 3, 48, 20)):
            x = torch.randn(shape)
            for _ in range(2):
                torch.testing.assert_close(runtime(x), module(x), rtol=1e-5, atol=1e-5)
        stats = runtime.stats()
        # Within the family's buckets but off the grid: its guard passes them, the input
        # check kept in the kernel refuses them as the interpreter does.
        with pytest.raises(ShapeError, match=r"dim 2 must be 8\*k for k in 2\.\.6, got 36"):
            runtime(torch.randn(2, 3, 36, 20))
        with pytest.raises(ShapeError, match=r"dim 3 must be 4\*w\+4 for w in 2\.\.6, got 21"):
            runtime(torch.randn(2, 3, 40, 21))
    assert stats["specialized_region_calls"] >= 3
    assert stats["family_compiles"] >= 1, stats
    assert stats["deopts"] == 0 and stats["specialize_failures_total"] == 0, stats


def test_verifier_refuses_bounds_off_the_grid(pooled):
    _, program = pooled
    spec = program.inputs[0]
    dims = (*spec.dims[:2], DimSpec("k", 17, 48, 8, 0), spec.dims[3])
    with pytest.raises(VerifyError, match=r"derived dim 8\*k with bounds \[17, 48\]"):
        verify(dataclasses.replace(program, inputs=(dataclasses.replace(spec, dims=dims),)))
