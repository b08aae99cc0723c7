"""Every demo model runs eagerly, exports with its declared dynamic dims, and the
exported program agrees with eager on inputs of sizes it was not traced with."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from torch.export import Dim

from dynvm.models import REGISTRY, DemoModel, get, transformer

NAMES = sorted(REGISTRY)


def _small(name: str) -> DemoModel:
    # A narrow 2-layer transformer keeps export + 5 eager runs cheap; the default
    # one is exported once in its own test.
    if name == "transformer":
        return transformer(layers=2, hidden=64, heads=4, ffn=128)
    return get(name)


def _expected_shape(name: str, inputs: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    x = inputs[0]
    return {
        "transformer": tuple(x.shape),
        "recommender": (x.shape[0], 1),
        "gnn": (1, 16),
        "branchy": tuple(x.shape),
        "looping": tuple(x.shape),
    }[name]


def _dims(model: DemoModel) -> list[dict[int, Dim]]:
    """The per-input {axis: Dim} dicts (None for fully static inputs)."""
    return [spec or {} for spec in model.dynamic_shapes]


@pytest.fixture(scope="module")
def exported() -> dict[str, tuple[DemoModel, torch.export.ExportedProgram]]:
    out = {}
    for name in NAMES:
        model = _small(name)
        out[name] = (
            model,
            torch.export.export(
                model.module, model.example_inputs, dynamic_shapes=model.dynamic_shapes
            ),
        )
    return out


def test_registry_and_get() -> None:
    assert set(REGISTRY) == {"transformer", "recommender", "gnn", "branchy", "looping"}
    with pytest.raises(KeyError, match="known models: branchy, gnn"):
        get("resnet")


@pytest.mark.parametrize("name", NAMES)
def test_eager_example_shape(name: str) -> None:
    model = _small(name)
    assert model.name == name and model.description
    assert not model.module.training
    with torch.no_grad():
        out = model.module(*model.example_inputs)
    assert isinstance(out, torch.Tensor)
    assert tuple(out.shape) == _expected_shape(name, model.example_inputs)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", NAMES)
def test_weights_are_seeded(name: str) -> None:
    state = torch.random.get_rng_state()
    a, b = _small(name), _small(name)
    # Building must not disturb the caller's RNG stream.
    assert torch.equal(state, torch.random.get_rng_state())
    for pa, pb in zip(a.module.parameters(), b.module.parameters(), strict=True):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("name", NAMES)
def test_sample_inputs_respect_ranges(name: str) -> None:
    model = _small(name)
    rng = random.Random(1234)
    seen: dict[str, set[int]] = {}
    for _ in range(40):
        inputs = model.sample_inputs(rng)
        assert len(inputs) == len(model.example_inputs)
        sizes: dict[str, int] = {}
        for t, ex, dims in zip(inputs, model.example_inputs, _dims(model), strict=True):
            assert t.dtype == ex.dtype and t.dim() == ex.dim()
            for axis in range(t.dim()):
                if axis in dims:
                    d = dims[axis]
                    assert d.min <= t.shape[axis] <= d.max, (d, t.shape)
                    # One Dim shared by several inputs must give them equal sizes.
                    assert sizes.setdefault(d.__name__, t.shape[axis]) == t.shape[axis]
                    seen.setdefault(d.__name__, set()).add(t.shape[axis])
                else:
                    assert t.shape[axis] == ex.shape[axis]
        if name == "gnn":
            edge_index = inputs[1]
            assert int(edge_index.min()) >= 0 and int(edge_index.max()) < inputs[0].shape[0]
    assert seen and all(len(v) > 5 for v in seen.values()), seen


@pytest.mark.parametrize("name", NAMES)
def test_export_matches_eager_on_fresh_shapes(name: str, exported) -> None:
    model, ep = exported[name]
    # The traced input sizes must be symbols, not the example's integers.
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    user = placeholders[-len(model.example_inputs) :]
    for node, dims in zip(user, _dims(model), strict=True):
        for axis in dims:
            assert isinstance(node.meta["val"].shape[axis], torch.SymInt), (node, axis)

    run = ep.module()
    rng = random.Random(NAMES.index(name))  # not hash(): str hashes vary per process
    shapes = set()
    for _ in range(5):
        inputs = model.sample_inputs(rng)
        shapes.add(tuple(tuple(t.shape) for t in inputs))
        with torch.no_grad():
            want = model.module(*inputs)
            got = run(*inputs)
        assert tuple(got.shape) == _expected_shape(name, inputs)
        torch.testing.assert_close(got, want)
    assert len(shapes) > 1


def test_branchy_takes_both_branches(exported) -> None:
    model, ep = exported["branchy"]
    x = model.sample_inputs(random.Random(7))[0]
    outs = []
    for shifted in (x.abs() + 0.1, -x.abs() - 0.1):
        with torch.no_grad():
            want = model.module(shifted)
        torch.testing.assert_close(ep.module()(shifted), want)
        outs.append(want)
    # The positive branch ends in a ReLU; the negative one is a residual tanh layer.
    assert (outs[0] >= 0).all() and (outs[1] < 0).any()


def test_looping_trip_count_varies(exported) -> None:
    model, _ = exported["looping"]
    rng = random.Random(3)
    trips = set()
    for _ in range(20):
        x = model.sample_inputs(rng)[0]
        trips.add(int(torch.clamp(torch.round(x.abs().mean() * 4), 1, 8)))
    assert len(trips) >= 4, trips


def test_control_flow_stays_in_graph(exported) -> None:
    # The data-dependent choice must be a higher-order op, not a branch baked in
    # for the example input.
    for name, hop in (("branchy", "cond"), ("looping", "while_loop")):
        ep = exported[name][1].run_decompositions({})
        targets = Counter(str(n.target) for n in ep.graph.nodes)
        assert targets[hop] == 1, targets


@pytest.mark.slow
def test_default_transformer_exports() -> None:
    model = transformer()
    ep = torch.export.export(
        model.module, model.example_inputs, dynamic_shapes=model.dynamic_shapes
    )
    x = torch.randn(3, 17, 256, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ep.module()(x), model.module(x))
