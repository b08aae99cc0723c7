"""A specialized region, the interpreter and eager PyTorch agree on random call sequences
(docs/ARCHITECTURE.md, Invariants): repeats of a few shapes (so that promotions and compiles really
happen), fresh shapes, and strided / offset / transposed-back views of the float input
with a shape that was already specialized (so guards must send them elsewhere).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dynvm
from dynvm.models import REGISTRY

h = importlib.import_module("tests.jit._jit_helpers")

STRAIGHT_LINE = {"transformer", "recommender", "gnn"}
VIEW_KINDS = ("strided", "offset", "transposed")


# ---------------------------------------------------------------- inputs ---------------


def size_strategy(name: str):
    if name == "transformer":
        return st.tuples(st.integers(1, 3), st.integers(2, 10))
    if name == "gnn":
        return st.tuples(st.integers(2, 20), st.integers(2, 40))
    return st.tuples(st.integers(1, 16))


def make_inputs(name: str, size: tuple, seed: int) -> tuple[torch.Tensor, ...]:
    """Contiguous inputs of `size` for the demo model `name` (the float input first)."""
    gen = torch.Generator().manual_seed(seed)
    if name == "transformer":
        b, s = size
        return (torch.randn(b, s, h.SMALL_TRANSFORMER["hidden"], generator=gen),)
    if name == "gnn":
        n, e = size
        return (torch.randn(n, 64, generator=gen), torch.randint(0, n, (2, e), generator=gen))
    if name == "recommender":
        (b,) = size
        sparse = tuple(torch.randint(0, rows, (b, bag), generator=gen)
                       for rows, bag in ((1000, 3), (800, 5), (1200, 1), (500, 4)))
        return (torch.randn(b, 13, generator=gen), *sparse)
    (b,) = size
    x = torch.randn(b, 32, generator=gen)
    if name == "looping":  # spread the trip count over its whole range
        x = x * (0.25 + 2.25 * torch.rand((), generator=gen))
    return (x,)


def as_view(x: torch.Tensor, kind: str) -> torch.Tensor:
    """A tensor equal to `x`, of its shape, but with other strides or a storage offset."""
    if kind == "strided":
        big = torch.zeros(x.shape[0], 2 * x.shape[1], *x.shape[2:])
        big[:, ::2] = x
        view = big[:, ::2]
    elif kind == "offset":
        big = torch.zeros(x.shape[0] + 1, *x.shape[1:])
        big[1:] = x
        view = big[1:]
    else:
        view = x.transpose(0, 1).contiguous().transpose(0, 1)
    assert view.shape == x.shape and torch.equal(view, x)
    return view


@st.composite
def scenario(draw, name: str):
    sizes = size_strategy(name)
    pool = draw(st.lists(sizes, min_size=2, max_size=3, unique=True))
    call = st.one_of(
        st.tuples(st.just("repeat"), st.integers(0, len(pool) - 1)),
        st.tuples(st.just("fresh"), sizes),
        st.tuples(st.sampled_from(VIEW_KINDS), st.integers(0, len(pool) - 1)),
    )
    # Three leading repeats guarantee that a promotion happens with K <= 2, and a final
    # view of that shape meets its specialization's guard (in sync mode).
    calls = [("repeat", 0)] * 3 + draw(st.lists(call, min_size=6, max_size=14))
    calls.append((draw(st.sampled_from(VIEW_KINDS)), 0))
    min_recurrence = draw(st.integers(1, 2))
    families = draw(st.booleans())   # code families (tier 1) on, or exact only
    return pool, calls, min_recurrence, families


# ---------------------------------------------------------------- the property ---------


_interpreters: dict[str, dynvm.Runtime] = {}


def interpreter(name: str) -> dynvm.Runtime:
    if name not in _interpreters:
        _interpreters[name] = dynvm.Runtime(h.compiled(name), jit=False)
    return _interpreters[name]


def check_call(name: str, jit_rt, inputs, what: str) -> None:
    before = [t.clone() for t in inputs]
    out_jit = jit_rt(*inputs)
    out_int = interpreter(name)(*inputs)
    if name == "looping":
        # Eager torch.while_loop insists that the carried value keep the input's
        # strides, so eager gets contiguous copies (the VM gets the views).
        out_eager = h.eager(h.demo(name).module, tuple(t.contiguous() for t in inputs))
    else:
        out_eager = h.eager(h.demo(name).module, inputs)
    h.assert_same(out_jit, out_int, what=f"{what}: jit vs interpreter")
    h.assert_same(out_int, out_eager, what=f"{what}: interpreter vs eager")
    for original, now in zip(before, inputs):
        assert torch.equal(original, now), f"{what}: an input was overwritten"


def run_scenario(name: str, sync: bool, pool, calls, min_recurrence, families: bool,
                 totals: dict) -> None:
    config = h.eager_config(sync=sync, min_recurrence=min_recurrence,
                            instructions_per_recurrence_step=24, families=families)
    with dynvm.Runtime(h.compiled(name), jit=config) as rt:
        for position, (kind, arg) in enumerate(calls):
            seed = 1000 * position + len(calls)
            if kind == "fresh":
                size = arg
                inputs = make_inputs(name, size, seed)
            else:
                size = pool[arg]
                inputs = make_inputs(name, size, seed)
                if kind != "repeat":
                    inputs = (as_view(inputs[0], kind), *inputs[1:])
            check_call(name, rt, inputs, f"{name} call {position} {kind} {size}")
        if not sync:
            h.wait_drained(rt)
            before = rt.stats()["specialized_region_calls"]
            for repeat in range(2):
                check_call(name, rt, make_inputs(name, pool[0], 7 + repeat),
                           f"{name} after drain, {pool[0]}")
            used = rt.stats()["specialized_region_calls"] - before
            if name in STRAIGHT_LINE:
                assert used == 2, f"{name}: the drained compile of {pool[0]} was not used"
        stats = rt.stats()
        assert stats["deopts"] == 0, rt.jit.event_log
        assert stats["compile_failures"] == 0, rt.jit.event_log
        totals["specialized"] += stats["specialized_region_calls"]
        totals["compiles"] += stats["compiles"]
        totals["guard_failures"] += stats["guard_failures"]
        totals["family_compiles"] += stats.get("family_compiles", 0)


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "async"])
@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_jit_interpreter_and_eager_agree(name: str, sync: bool) -> None:
    totals = {"specialized": 0, "compiles": 0, "guard_failures": 0, "family_compiles": 0}

    @settings(max_examples=10, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(scenario(name))
    def prop(case) -> None:
        pool, calls, min_recurrence, families = case
        run_scenario(name, sync, pool, calls, min_recurrence, families, totals)

    with h.torch_threads(1):
        prop()
    assert totals["compiles"] > 0, totals
    if name in STRAIGHT_LINE:
        assert totals["specialized"] > 0, totals
    if sync:
        # Views of an already-specialized shape reach a guard and fail it.
        assert totals["guard_failures"] > 0, totals
