"""Note [Promotion by kind]: exact kernels and family kernels learn their speed-up and
compile cost from their own kind, so a family kernel that merely ties the interpreter,
or a family compile that is slow, does not stop the region's exact shapes from being
promoted (and the other way round)."""

from __future__ import annotations

import dynvm
from dynvm.jit.config import JitConfig
from dynvm.jit.policy import EXACT, FAMILY
from tests.jit._jit_helpers import compiled


def _region(config: JitConfig):
    runtime = dynvm.Runtime(compiled("recommender"), "cpu", jit=config)
    return runtime, next(iter(runtime.jit.regions.values()))


def test_a_compile_of_one_kind_sets_only_that_kinds_estimate():
    config = JitConfig()
    runtime, region_jit = _region(config)
    jit, size = runtime.jit, len(region_jit.region)
    runtime.close()
    prior = config.compile_seconds_base + config.compile_seconds_per_instruction * size
    assert jit.estimated_compile_seconds(size, EXACT) == prior
    assert jit.estimated_compile_seconds(size, FAMILY) == prior
    jit._compile_rates[FAMILY].append(0.01)   # one slow family compile
    assert jit.estimated_compile_seconds(size, FAMILY) == \
        config.compile_seconds_base + 0.01 * size
    assert jit.estimated_compile_seconds(size, EXACT) == prior


def test_a_tying_family_verdict_leaves_the_exact_expectation_alone():
    config = JitConfig(expected_speedup=0.15)
    runtime, region_jit = _region(config)
    region_jit.savings.record(FAMILY, 0.97)   # a family kernel that ties
    inputs = region_jit.refresh_policy_inputs()
    assert abs(inputs.speedup(FAMILY) - 0.03) < 1e-9
    assert inputs.speedup(EXACT) == 0.15
    region_jit.savings.record(EXACT, 0.6)     # an exact kernel that wins
    inputs = region_jit.refresh_policy_inputs()
    assert abs(inputs.speedup(EXACT) - 0.4) < 1e-9
    assert abs(inputs.speedup(FAMILY) - 0.03) < 1e-9
    assert inputs.cost(EXACT) == runtime.jit.estimated_compile_seconds(
        len(region_jit.region), EXACT)
    runtime.close()


def test_a_kind_without_verdicts_borrows_the_other_kinds_saving_when_better():
    runtime, region_jit = _region(JitConfig(expected_speedup=0.15))
    region_jit.savings.record(FAMILY, 0.6)    # a family kernel that wins
    assert abs(region_jit.refresh_policy_inputs().speedup(EXACT) - 0.4) < 1e-9
    region_jit.savings.record(EXACT, 0.95)    # then its kind's own evidence rules
    assert abs(region_jit.refresh_policy_inputs().speedup(EXACT) - 0.05) < 1e-9
    runtime.close()


def test_exact_shapes_are_promoted_after_a_costly_family_that_ties():
    """The region's one signature recurs; its family has already been compiled (a slow
    compile) and measured tying the interpreter. The exact key still pays on its own
    kind's figures, and is promoted."""
    config = JitConfig(families=False, min_recurrence=2, max_recurrence=2,
                       horizon_calls=1000, expected_speedup=0.3)
    runtime, region_jit = _region(config)
    size = len(region_jit.region)
    runtime.jit._compile_rates[FAMILY].append(1.0 / size)   # a 1 s family compile
    region_jit.savings.record(FAMILY, 0.97)
    region_jit._policy_inputs = None
    signature = (("signature", 0),)
    promoted = None
    for _ in range(8):
        promoted = region_jit._observe(signature, 0.01) or promoted
    assert promoted is not None, region_jit.refresh_policy_inputs()
    target, decision = promoted
    assert target == signature and decision.promote
    runtime.close()
