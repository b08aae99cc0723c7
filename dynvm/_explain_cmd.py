"""`dynvm explain`: what the JIT makes of one input shape.

It runs the program on random inputs of the requested shape with the JIT compiling
synchronously at the first sight of a signature, then prints, per specialized region,
the guard, the rewrites the specializer made and the generated source.
"""

from __future__ import annotations

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
EXPLAIN_CONFIG = JitConfig(sync=True, min_recurrence=1, max_recurrence=1,
                           expected_speedup=1.0, horizon_calls=10**9)


def explain_command(args, program, demo) -> int:
    schedules = parse_schedule(args.shape) if args.shape else ()
    check_schedule(schedules, program)
    draw = input_source(program, demo, schedules, args.seed)
    inputs = draw()
    shapes = ", ".join(f"{spec.name}={list(t.shape)}" for spec, t in zip(program.inputs,
                                                                         inputs))
    telemetry = make_telemetry(args.trace)
    try:
        return _explain(program, inputs, shapes, telemetry)
    finally:
        telemetry.shutdown()


def _explain(program, inputs, shapes: str, telemetry) -> int:
    with dynvm.Runtime(program, jit=EXPLAIN_CONFIG, telemetry=telemetry) as runtime:
        if runtime.jit is None:
            raise CliError(f"the JIT is disabled by {runtime.jit_disabled_by} in the "
                           f"environment; explain shows what it compiles, unset it")
        try:
            runtime(*inputs)
        except dynvm.DynvmError as exc:
            raise CliError(f"the program rejects these inputs ({shapes}): {exc}") from None
        artifacts = list(runtime.jit.artifacts.values())
        print(f"; {program.name} with {shapes}: {len(artifacts)} specialized region(s) of "
              f"{len(program.regions)}")
        for line in runtime.jit.event_log:
            print(f"; note: {line}")
        for artifact in artifacts:
            print(f"\n; {artifact.kernel_name}: guard {artifact.guard}, compiled in "
                  f"{artifact.compile_seconds * 1e3:.1f} ms, cache key {artifact.key[:16]}")
            for note in artifact.notes:
                print(f";   {note}")
            print(artifact.source)
    return 0
