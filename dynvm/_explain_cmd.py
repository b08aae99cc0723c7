"""`dynvm explain`: what the JIT makes of one input shape.

It runs the program on random inputs of the requested shape with the JIT compiling
synchronously at the first sight of a signature, then calls it again on the same inputs
until every specialization has its probation verdict (Note [Probation]: each of those
calls is a shadow call, interpreter and specialization timed on the same inputs), then
prints, per specialized region, the guard, the measured ratio to the interpreter, the
rewrites the specializer made and the generated source; and any specialization failure
(a dynvm bug, Note [Failure accounting]).
"""

from __future__ import annotations

import torch.utils._pytree as pytree

import dynvm
from dynvm._run_cmd import (
    CliError,
    check_schedule,
    input_source,
    make_telemetry,
    parse_schedule,
)
from dynvm.jit.config import JitConfig

# Promote on first sight, whatever the region costs: explain is about what would be
# compiled, not whether the policy would pay for it.
# Every hit a shadow call, so the verdicts come after `probation_samples` more calls.
EXPLAIN_CONFIG = JitConfig(sync=True, min_recurrence=1, max_recurrence=1,
                           expected_speedup=1.0, horizon_calls=10**9,
                           probation_shadow_every=1)
# A demotion re-plans and measures again: room for two probations (each with its
# warm-up hit before the samples) and the first call; the loop stops once settled.
MEASURE_CALLS = 2 * (EXPLAIN_CONFIG.probation_samples + 1) + 1


def explain_command(args, program, demo) -> int:
    """`dynvm explain`: run one call of the given shape through a JIT that
    compiles at once and print the guards, rewrites and generated code; the exit status."""
    schedules = parse_schedule(args.shape) if args.shape else ()
    check_schedule(schedules, program)
    draw = input_source(program, demo, schedules, args.seed)
    inputs = draw()
    shapes = ", ".join(f"{spec.name}={list(t.shape)}" for spec, t in zip(program.inputs,
                                                                         inputs))
    telemetry = make_telemetry(args.trace)
    # A nested program (lists of tensors, dicts) takes its inputs in its own structure.
    call_args = pytree.tree_unflatten(inputs, pytree.treespec_loads(program.in_spec))
    try:
        return _explain(program, call_args, shapes, telemetry)
    finally:
        telemetry.shutdown()


def _explain(program, inputs, shapes: str, telemetry) -> int:
    with dynvm.Runtime(program, jit=EXPLAIN_CONFIG, telemetry=telemetry) as runtime:
        if runtime.jit is None:
            raise CliError(f"the JIT is disabled by {runtime.jit_disabled_by} in the "
                           f"environment; explain shows what it compiles, unset it")
        try:
            for _ in range(MEASURE_CALLS):
                runtime(*inputs)
                if runtime.settled():
                    break
        except dynvm.DynvmError as exc:
            raise CliError(f"the program rejects these inputs ({shapes}): {exc}") from None
        artifacts = list(runtime.jit.artifacts.values())
        installed = {spec.artifact.key: spec for region in runtime.jit.regions.values()
                     for spec in region.installed()}
        print(f"; {program.name} with {shapes}: {len(artifacts)} specialized region(s) of "
              f"{len(program.regions)}")
        failures = runtime.stats().specialize_failures or {}
        for reason, count in failures.items():
            print(f"; SPECIALIZATION FAILED (a dynvm bug) x{count}: {reason}")
        for line in runtime.jit.event_log:
            print(f"; note: {line}")
        for artifact in artifacts:
            print(f"\n; {artifact.kernel_name}: guard {artifact.guard}, compiled in "
                  f"{artifact.compile_seconds * 1e3:.1f} ms, cache key {artifact.key[:16]}")
            print(f"; measured: {_measured(installed.get(artifact.key))}")
            for note in artifact.notes:
                print(f";   {note}")
            print(artifact.source)
    return 0


def _measured(spec) -> str:
    """The probation verdict of an artifact's specialization (Note [Probation])."""
    if spec is None:
        return "not installed (demoted or dropped: see the notes above)"
    if spec.ratio is not None:
        return (f"{spec.ratio:.3f}x the interpreter on its calls (median of paired "
                f"shadow calls), kept")
    if spec.probation is not None:
        return (f"on probation, {len(spec.probation.ratios)} of "
                f"{spec.probation.samples} shadow calls so far")
    return "not measured (probation off)"
