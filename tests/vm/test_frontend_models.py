"""Every demo model, compiled by the frontend, saved to a .dvm file and loaded back, gives
the same outputs as eager PyTorch on random draws of its dynamic dims.

Tolerance: outputs are compared with ``torch.testing.assert_close(rtol=1e-5, atol=1e-5)``.
This is the documented tolerance of the interpreter against eager: the VM calls the same
ATen kernels in the same order, so results are normally bit-identical; the tolerance only
covers kernel selection differences (a different matmul/reduction path chosen for a
different stride or thread count).
"""

from __future__ import annotations

import random

import pytest
import torch

import dynvm
import dynvm.vm.verifier
from dynvm.models._base import generator
from tests.vm._programs import NAMES, compiled, demo, torch_threads

RTOL = ATOL = 1e-5
DRAWS = 20
# The default 6-layer transformer is the slow one: its draws are capped at
# batch <= 16, seq <= 64 (sample_inputs goes up to 64 x 128) to keep the suite quick.
TRANSFORMER_MAX_BATCH, TRANSFORMER_MAX_SEQ = 16, 64


def draw(name: str, seed: int) -> tuple[torch.Tensor, ...]:
    dm = demo(name)
    rng = random.Random(seed)
    if name != "transformer":
        return dm.sample_inputs(rng)
    hidden = dm.example_inputs[0].shape[-1]
    b = rng.randint(1, TRANSFORMER_MAX_BATCH)
    s = rng.randint(2, TRANSFORMER_MAX_SEQ)
    return (torch.randn(b, s, hidden, generator=generator(rng)),)


def eager(name: str, inputs: tuple[torch.Tensor, ...]):
    with torch.inference_mode():
        return demo(name).module(*inputs)


def assert_same(actual, expected) -> None:
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("name", NAMES)
def test_saved_and_loaded_program_matches_eager(name, tmp_path):
    program = compiled(name)
    path = tmp_path / f"{name}.dvm"
    dynvm.save(program, path)
    loaded = dynvm.load(path)
    assert loaded.content_hash == program.content_hash
    assert loaded.code == program.code
    runtime = dynvm.Runtime(loaded)
    seen_shapes = set()
    with torch_threads(1):
        for seed in range(DRAWS):
            inputs = draw(name, seed)
            seen_shapes.add(tuple(tuple(x.shape) for x in inputs))
            out = runtime(*inputs)
            assert_same(out, eager(name, inputs))
    # The draws really exercise the dynamic dims (not one shape 20 times).
    assert len(seen_shapes) > DRAWS // 2
    assert runtime.stats()["calls"] == DRAWS


def _instructions_per_call(runtime: dynvm.Runtime, inputs) -> int:
    before = runtime.stats()["instructions_executed"]
    runtime(*inputs)
    return runtime.stats()["instructions_executed"] - before


def test_looping_trip_count_varies_and_vm_loops_that_often():
    # The model's docstring: trips = clamp(round(mean|x| * 4), 1, 8).
    runtime = dynvm.Runtime(compiled("looping"))
    trips_and_steps = []
    for seed in range(DRAWS):
        (x,) = draw("looping", seed)
        trips = int(torch.clamp(torch.round(x.abs().mean() * 4.0), 1, 8))
        trips_and_steps.append((trips, _instructions_per_call(runtime, (x,))))
        assert_same(runtime(x), eager("looping", (x,)))
    distinct_trips = {t for t, _ in trips_and_steps}
    assert len(distinct_trips) >= 3, distinct_trips
    # The VM's work is affine in the trip count: a fixed cost plus one loop body per trip.
    (t0, s0), *rest = sorted(set(trips_and_steps))
    per_trip = {(s - s0) / (t - t0) for t, s in rest}
    assert len(per_trip) == 1 and per_trip.pop() > 0, trips_and_steps


def test_branchy_takes_both_branches():
    # The model's docstring: torch.cond(x.mean() > 0, deep MLP, tanh residual).
    runtime = dynvm.Runtime(compiled("branchy"))
    steps_by_branch: dict[bool, set[int]] = {True: set(), False: set()}
    for seed in range(DRAWS):
        (x,) = draw("branchy", seed)
        steps_by_branch[bool(x.mean() > 0)].add(_instructions_per_call(runtime, (x,)))
        assert_same(runtime(x), eager("branchy", (x,)))
    assert steps_by_branch[True] and steps_by_branch[False], "a branch was never taken"
    # Each branch is one fixed path through the code, and the two paths differ.
    assert len(steps_by_branch[True]) == len(steps_by_branch[False]) == 1
    assert steps_by_branch[True] != steps_by_branch[False]


def _views_like(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Non-contiguous / offset tensors with x's shape and dtype, each with its own data."""
    shape = tuple(x.shape)
    wide = torch.randn(*shape[:-1], 2 * shape[-1])
    longer = torch.randn(shape[0] + 1, *shape[1:])
    reversed_dims = torch.randn(*reversed(shape))
    views = {
        "strided": wide[..., ::2],
        "offset": longer[1:],
        "transposed_back": reversed_dims.permute(*reversed(range(x.dim()))),
    }
    if x.dim() == 3:
        views["strided_middle"] = torch.randn(shape[0], 2 * shape[1], shape[2])[:, ::2]
    for label, view in views.items():
        assert view.shape == x.shape, label
        assert not view.is_contiguous() or view.storage_offset() > 0, label
    return views


@pytest.mark.parametrize("name", ["transformer", "gnn"])
def test_strided_and_offset_views_as_inputs(name):
    runtime = dynvm.Runtime(compiled(name))
    with torch_threads(1):
        for seed in range(3):
            inputs = draw(name, 100 + seed)
            for label, view in _views_like(inputs[0]).items():
                view_inputs = (view, *inputs[1:])
                snapshot = view.clone()
                out = runtime(*view_inputs)
                expected = eager(name, view_inputs)
                assert_same(out, expected)
                # ... and it is also the result for the same values laid out densely.
                assert_same(out, eager(name, (view.contiguous(), *inputs[1:])))
                assert torch.equal(view, snapshot), f"{label}: the VM wrote into its input"


@pytest.mark.parametrize("dim", [torch.export.Dim("rows"), torch.export.Dim.AUTO],
                         ids=["Dim without bounds", "Dim.AUTO"])
def test_a_dim_declared_without_bounds_compiles_and_runs(dim, tmp_path):
    # torch reports such a dim's upper bound as its own infinity (int_oo), whose
    # is_finite is True: the frontend once crashed on int(int_oo).
    model = torch.nn.Linear(4, 3).eval()
    program = dynvm.compile(model, (torch.randn(2, 4),), dynamic_shapes=({0: dim},))
    rows = program.inputs[0].dims[0]
    assert rows.low <= 2 and rows.high == dynvm.vm.verifier.MAX_DIM
    dynvm.save(program, tmp_path / "m.dvm")
    runtime = dynvm.Runtime(dynvm.load(tmp_path / "m.dvm"), jit=False)
    x = torch.randn(37, 4)
    torch.testing.assert_close(runtime(x), model(x), rtol=RTOL, atol=ATOL)
