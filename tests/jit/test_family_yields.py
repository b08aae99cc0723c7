"""Note [A family that does not pay] (dynvm.jit.policy): a member of a family of
several shapes is weighed as its own exact key when its family backs off or does not pay
for its compile, so that the members get exact kernels instead of staying interpreted
(efficientnet in the zoo: its family kernel dropped at 1.09x the interpreter, its two
member shapes never compiled though each would save ~7x its exact compile). On the small
transformer of tests.jit.test_families_arenas, compiled and run for real (no mocks)."""

from __future__ import annotations

import dynvm
from dynvm.jit.policy import FAMILY
from tests.jit.test_families_arenas import (
    HIDDEN,
    SEQ,
    check,
    eager,
    family_config,
    one_thread,  # noqa: F401 — the autouse fixture of that module, here too
    region,
    small,  # noqa: F401 — the module-scoped program fixture
    strong_dims,
    x_of,
)

MEMBERS = (20, 30)   # one bucket (17..64) of the batch dim: one family of two shapes


def _rotate(runtime, inputs, rounds: int) -> None:
    for _ in range(rounds):
        for b in MEMBERS:
            runtime(inputs[b])


def _members_served_exactly(runtime, dm, inputs) -> None:
    exact = strong_dims(runtime)
    assert set(exact) == {(b, SEQ, HIDDEN) for b in MEMBERS}, sorted(exact)
    assert not region(runtime).family_kernels
    for b in MEMBERS:   # each member runs its exact kernel now, and agrees with eager
        spec, calls = exact[(b, SEQ, HIDDEN)], exact[(b, SEQ, HIDDEN)].calls
        check(runtime(inputs[b]), eager(dm.module, inputs[b]), f"batch {b}")
        assert spec.calls == calls + 1, f"batch {b} not served by its exact kernel"


def test_members_of_a_family_that_does_not_pay_get_exact_kernels(small):  # noqa: F811
    """The region's family kind measured a loss (1.09x, efficientnet's) and a slow
    compile: no family of it pays at any age, while each member's exact kernel does.
    Before: the members were weighed as the family only, and stayed interpreted."""
    dm, program, _ = small
    runtime = dynvm.Runtime(program, jit=family_config())
    region_jit = region(runtime)
    runtime.jit._compile_rates[FAMILY].append(1e9)   # a family compile: forever
    region_jit.savings.record(FAMILY, 1.09)
    inputs = {b: x_of(b, seed=b) for b in MEMBERS}
    _rotate(runtime, inputs, 2 * region_jit.threshold)
    assert runtime.stats()["compiles"] == len(MEMBERS), runtime.stats()
    _members_served_exactly(runtime, dm, inputs)
    runtime.close()


def test_members_of_a_family_backing_off_get_exact_kernels(small):  # noqa: F811
    """The family's key backs off (as after a failed compile, or a probation drop) for
    longer than the test runs. Before: its members waited for the back-off, interpreted."""
    dm, program, _ = small
    runtime = dynvm.Runtime(program, jit=family_config(failed_compile_backoff_calls=10**6))
    region_jit = region(runtime)
    inputs = {b: x_of(b, seed=b) for b in MEMBERS}
    for b in MEMBERS:   # the second shape makes the batch dim vary: the family
        runtime(inputs[b])
    family = region_jit.families.family_of(next(iter(region_jit.profile.table)))
    assert family.bounds[0][0] == (17, 64), family.key
    region_jit.compile_failed(family.key)
    _rotate(runtime, inputs, 2 * region_jit.threshold)
    assert runtime.stats()["compiles"] == len(MEMBERS), runtime.stats()
    _members_served_exactly(runtime, dm, inputs)
    runtime.close()


def test_a_family_that_pays_still_comes_first(small):  # noqa: F811
    """Where the family pays, its members are weighed as the family as before: one
    family kernel serves both (Note [Tiering])."""
    dm, program, _ = small
    runtime = dynvm.Runtime(program, jit=family_config())
    inputs = {b: x_of(b, seed=b) for b in MEMBERS}
    _rotate(runtime, inputs, 2)   # the first call's family is itself (one shape)
    (family,) = region(runtime).family_kernels.values()
    assert not strong_dims(runtime)
    for b in MEMBERS:
        calls = family.calls
        check(runtime(inputs[b]), eager(dm.module, inputs[b]), f"batch {b}")
        assert family.calls == calls + 1
    runtime.close()
