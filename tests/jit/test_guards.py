"""Guards (Note [Guard strength]): a view never reaches code compiled for a contiguous
tensor, a failure is counted and explained (first failing check, expected vs actual),
and a specialization that assumed nothing about shapes gets a weak guard that serves
every shape of the same rank and element count.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import dynvm
from dynvm.jit.guards import (
    GuardStrength,
    describe,
    first_failure,
    strong_signer,
    weak_of,
    weak_signer,
)

h = importlib.import_module("tests.jit._jit_helpers")

BATCH = 8


def recommender_inputs(b: int = BATCH, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    sparse = tuple(torch.randint(0, rows, (b, bag), generator=gen)
                   for rows, bag in ((1000, 3), (800, 5), (1200, 1), (500, 4)))
    return (torch.randn(b, 13, generator=gen), *sparse)


def transposed_back(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous().t()


def with_offset(x: torch.Tensor) -> torch.Tensor:
    big = torch.randn(x.shape[0] + 1, *x.shape[1:])
    big[1:] = x
    return big[1:]


# ---------------------------------------------------------------- the classic trap -----


@pytest.mark.parametrize("view, check, expected, actual", [
    (transposed_back, "strides", (13, 1), (1, BATCH)),
    (with_offset, "storage offset", 0, 13),
])
def test_view_of_a_specialized_shape_fails_the_strong_guard(view, check, expected, actual):
    program = h.compiled("recommender")
    interp = dynvm.Runtime(program, jit=False)
    inputs = recommender_inputs()
    with dynvm.Runtime(program, jit=h.eager_config(guard_failure_sample_rate=1)) as rt:
        rt(*inputs)
        rt(*inputs)
        stats = rt.stats()
        assert stats["compiles"] == 1 and stats["specialized_region_calls"] == 1
        (spec,) = rt.jit.regions[0].strong.values()
        assert spec.strength is GuardStrength.STRONG

        viewed = (view(inputs[0]), *inputs[1:])
        assert viewed[0].shape == inputs[0].shape
        out = rt(*viewed)
        h.assert_same(out, interp(*viewed), rtol=0, atol=0)
        h.assert_same(out, h.eager(h.demo("recommender").module, viewed))
        stats = rt.stats()
        assert stats["guard_failures"] == 1
        assert stats["interpreted_region_calls"] == 2
        assert stats["specialized_region_calls"] == 1
        message = stats["regions"][0]["last_guard_failure"]
        assert message == f"live-in %0 {check}: expected {expected!r}, got {actual!r}"
        assert any(message in line for line in rt.jit.event_log)


def test_guard_failures_are_sampled():
    program = h.compiled("recommender")
    inputs = recommender_inputs()
    config = h.eager_config(guard_failure_sample_rate=4, min_recurrence=2)
    with dynvm.Runtime(program, jit=config) as rt:
        rt(*inputs)
        rt(*inputs)
        explained = []
        for k in range(1, 8):  # seven new signatures, each seen once: never promoted
            big = torch.randn(BATCH + k, 13)
            big[k:] = inputs[0]
            rt(*(big[k:], *inputs[1:]))
            explained.append(rt.stats()["regions"][0]["last_guard_failure"])
        assert rt.stats()["guard_failures"] == 7
        assert rt.stats()["compiles"] == 1
    # The first failure is explained, then one in four (the 5th); the rest only counted.
    got = [None if m is None else int(m.rsplit("got ", 1)[1]) for m in explained]
    assert got == [13, 13, 13, 13, 65, 65, 65], explained


def test_strong_signature_sees_strides_and_offset_weak_does_not():
    x = torch.randn(BATCH, 13)
    views = [transposed_back(x), with_offset(x)]
    strong, weak = strong_signer((0,)), weak_signer((0,))
    for view in views:
        assert strong([view]) != strong([x])
        assert weak([view]) == weak([x])
        assert describe(strong([view])) != describe(strong([x]))
    assert weak([x.reshape(13, BATCH)]) == weak([x])
    assert weak([x.reshape(-1)]) != weak([x])             # another rank
    assert weak([x.double()]) != weak([x])
    assert weak_of(strong([x])) == weak([x])
    assert strong([x.clone()]) == strong([x])             # shapes are interned
    scalar = strong_signer((0, 1))
    assert scalar([x, 3]) != scalar([x, 4])
    assert scalar([x, 3]) == scalar([x.clone(), 3])


def test_size_one_dims_with_other_strides_are_other_signatures():
    # (1, 8) tensors with strides (8, 1) and (1, 1) are both "contiguous" to torch, but
    # differ as signatures; their artifacts must not share a cache key, or the second
    # is never compiled and stays pending forever.
    a = torch.randn(1, 8)
    b = torch.randn(8, 1).t()
    assert a.shape == b.shape and a.stride() != b.stride()
    sign = strong_signer((0,))
    assert sign([a]) != sign([b])
    assert describe(sign([a])) != describe(sign([b]))


def test_every_signature_gets_its_own_specialization():
    program = h.build("""
       0  %1 = DIM %0, 0
       1  %2 = RELU %0
       2  %3 = VIEW %2, [%1, -1]
       3  %4 = TANH %3
       4  RETURN {%4}
    """, regs=5, inputs=('"x" float32 [n:1..64, m:1..64]',))
    a = torch.randn(1, 8)
    b = torch.randn(8, 1).t()
    with dynvm.Runtime(program, jit=h.eager_config()) as rt:
        for x in (a, a, b, b, b):
            torch.testing.assert_close(rt(x), torch.tanh(torch.relu(x)))
        rj = rt.jit.regions[0]
        assert not rj.pending
        assert rt.stats()["compiles"] == 2
        assert rt.stats()["specialized_region_calls"] == 3


# ---------------------------------------------------------------- explanations ---------


def test_first_failure_names_the_check_with_expected_and_actual():
    sign = strong_signer((3,))
    base = torch.randn(4, 8)

    def fails(other: torch.Tensor) -> str | None:
        regs = [None] * 3
        return first_failure((3,), sign(regs + [base]), sign(regs + [other]),
                             GuardStrength.STRONG)

    assert fails(base.clone()) is None
    assert fails(torch.randn(8, 4)) == "live-in %3 shape: expected (4, 8), got (8, 4)"
    assert fails(base.double()) == ("live-in %3 dtype: expected torch.float32, "
                                    "got torch.float64")
    assert fails(transposed_back(base)) == "live-in %3 strides: expected (8, 1), got (1, 4)"
    assert fails(with_offset(base)) == "live-in %3 storage offset: expected 0, got 8"
    assert fails(base.to("meta")) == ("live-in %3 device: expected device(type='cpu'), "
                                      "got device(type='meta')")


def test_first_failure_of_weak_guards_and_scalars():
    live_in = (0, 1)
    weak = weak_signer(live_in)
    x = torch.randn(4, 8)
    want = weak([x, 2])
    assert first_failure(live_in, want, weak([x.reshape(8, 4), 2]), GuardStrength.WEAK) is None
    assert first_failure(live_in, want, weak([x.reshape(-1), 2]), GuardStrength.WEAK) == (
        "live-in %0 rank: expected 2, got 1")
    assert first_failure(live_in, want, weak([torch.randn(4, 9), 2]), GuardStrength.WEAK) == (
        "live-in %0 element count: expected 32, got 36")
    assert first_failure(live_in, want, weak([x, 3]), GuardStrength.WEAK) == (
        "live-in %1: expected 2, got 3")
    strong = strong_signer(live_in)
    assert first_failure(live_in, strong([x, 2]), strong([x, 2.5]), GuardStrength.STRONG) == (
        "live-in %1: expected 2, got 2.5")


# ---------------------------------------------------------------- weak vs strong -------

ELEMENTWISE = """
   0  %1 = RELU %0
   1  %2 = TANH %0
   2  RETURN {%1, %2}
"""
WITH_ASSERT = """
   0  SHAPE_ASSERT %0, "x", torch.float32, device("cpu"), ((1, 64, "n"), (1, 64, "m"))
   1  %1 = RELU %0
   2  %2 = TANH %0
   3  RETURN {%1, %2}
"""
WITH_VIEW = """
   0  %3 = DIM %0, 0
   1  %1 = RELU %0
   2  %4 = VIEW %1, [%3, -1]
   3  %2 = TANH %0
   4  RETURN {%4, %2}
"""
INPUT_2D = ('"x" float32 [n:1..64, m:1..64]',)


def elementwise_reference(x):
    return torch.relu(x), torch.tanh(x)


def test_region_that_assumes_nothing_gets_a_weak_guard_serving_other_shapes():
    program = h.build(ELEMENTWISE, regs=3, inputs=INPUT_2D, outputs=2)
    x = torch.randn(4, 8)
    with dynvm.Runtime(program, jit=h.eager_config(guard_failure_sample_rate=1)) as rt:
        h.assert_same(rt(x), elementwise_reference(x), rtol=0, atol=0)
        rj = rt.jit.regions[0]
        assert not rj.strong
        (spec,) = rj.weak.values()
        assert spec.strength is GuardStrength.WEAK
        assert spec.artifact.guard == "weak"
        # Same rank and element count: served by the one weak specialization, layouts
        # included (it runs the interpreter's own operations).
        for other in (torch.randn(8, 4), torch.randn(2, 16), torch.randn(8, 4).t(),
                      with_offset(torch.randn(32, 1))):
            h.assert_same(rt(other), elementwise_reference(other), rtol=0, atol=0)
        stats = rt.stats()
        assert stats["specialized_region_calls"] == 4
        assert stats["compiles"] == 1 and stats["guard_failures"] == 0
        # Another element count fails the weak guard, explained in its terms.
        odd = torch.randn(4, 9)
        h.assert_same(rt(odd), elementwise_reference(odd), rtol=0, atol=0)
        stats = rt.stats()
        assert stats["guard_failures"] == 1
        assert stats["regions"][0]["last_guard_failure"] == (
            "live-in %0 element count: expected 32, got 36")


@pytest.mark.parametrize("body, outputs", [(WITH_ASSERT, "assert"), (WITH_VIEW, "view")])
def test_shape_check_or_shape_dependent_view_makes_the_guard_strong(body, outputs):
    program = h.build(body, regs=5, inputs=INPUT_2D, outputs=2)
    x = torch.randn(4, 8)
    with dynvm.Runtime(program, jit=h.eager_config()) as rt:
        h.assert_same(rt(x), elementwise_reference(x), rtol=0, atol=0)
        rj = rt.jit.regions[0]
        assert not rj.weak
        (spec,) = rj.strong.values()
        assert spec.strength is GuardStrength.STRONG
        other = torch.randn(8, 4)
        h.assert_same(rt(other), elementwise_reference(other), rtol=0, atol=0)
        stats = rt.stats()
        assert stats["specialized_region_calls"] == 0
        assert stats["guard_failures"] == 1
