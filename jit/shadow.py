"""Probation's shadow samples (Note [Probation] in jit.probation): the sample itself, run
on the compile worker, and how often samples may sit beside the calls they slow.

Note [Shadow samples beside calls]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A shadow sample runs the whole region in the interpreter and again in the kernel, one
step each on the compile worker, each started once no call is in flight (Note
[Background work yields to calls] in jit.background). Under traffic with no gap a step
begun in the gap after one call runs beside the next, and takes its cores and its GIL:
in BERT-base width's 200-call warm-up (bench.warmup_bar's calls, 2026-12-06 04:30 UTC,
load 8-10) the JIT's calls beside a shadow sample took 1.55x the same step's
interpreter call (n=23, median), the largest cause of its slow calls; 49-53 samples a
warm-up, most of them the early samples probation takes on consecutive hits.

So samples are spaced while calls arrive. A sample *collides* when a call was in flight
at one of its checkpoints or at its end, or one began while it ran. After a colliding
sample the process's next sample waits until `SHADOW_SPACING` calls have begun (every
Runtime's calls: they share the cores). A hit whose sample is due while the spacing is
unmet defers it to its kernel's next hit (`Probation.due`), at most
`MAX_DEFERRED` (jit.probation) times in a row; then it samples anyway. A family
kernel's early samples are never deferred: while it has fewer than EARLY_SAMPLES the
region's next family waits (Note [Probation]: the family bet), and deferred they held
BERT's warm-up to 12-13 compiles of 17 (kernel calls 72-82 of 200 against 100). With
gaps between calls (a sample that meets no call), the zoo's drained calls, or the
synchronous switch (the sample runs on the call, before it), nothing is deferred.
Each of a sample's two timed runs starts in a gap even inside the worker's slice of
work (Note [A slice of work per wait] in jit.background; `checkpoint(gap=True)`): the
hit that queued the sample is still in flight when the worker takes it, and a run begun
beside that call's end both slowed it and counted as a collision, spacing the next
sample though the calls had gaps (a suite's rehearsal on a loaded host deferred an
early sample that way).

The bound: each sample comes at most `MAX_DEFERRED` hits late, so a kernel at or above
`EARLY_LOSS` on every sample is dropped by its 1 + EARLY_SAMPLES x (MAX_DEFERRED + 1)-th
hit (33; 5 unspaced, and a family kernel's), plus the hit that acts on the verdict;
the full verdict (12 samples) by its 1 + 4 x 8 + 8 x (every + MAX_DEFERRED) = 121st (37
unspaced, every = 4; a family kernel's 93).
Every sample is still taken, on the kernel's own hits; only when changes. A kernel
serves its calls while on probation, so a deferred verdict costs a winner nothing and a
loser at most those hits (what else waits on a verdict: Note [Settled]).

Note [A shadow sample pauses for calls]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The spacing bounds how often a sample meets a call, not what a meeting costs: a run
begun in a gap is a whole region in the interpreter, and a call that begins during it
shares the cores with all that is left of it. In BERT-base width's 200-call warm-up
(2026-12-06 18:40 UTC, 2-core AMD EPYC, per-call telemetry of one cold process) the
worker was busy 11.2 s, and the interpreter's runs of shadow samples were the largest
part of it (4.0 s, up to 0.7 s each at 8x128); a JIT call at 8x16 that began beside one
took 104 ms against the interpreter's median of 52.

So on the compile worker the interpreter's run checks, between its steps, whether a
call is in flight (one attribute read), and if one is it comes to a checkpoint (Note [A
slice of work per wait] in jit.background): past its slice it waits for the call to
end, as every other step of background work does. A call that begins during the run
then shares the cores with one step of it (an op), not the rest of the region. The
waits are not the interpreter's time: the sample's ratio counts the steps' clock only.
What a pause leaves is the cache the call used, which the next steps refill; the
calibrator's medians absorb that as they absorb any sample timed beside a call. The
kernel's side pauses the same way, between the lines of its generated code (Note [A
kernel's run on the worker pauses for calls] in jit.background), where its hits average
`PACED_FROM_S` or more: the trace that finds the lines costs ~0.2 us a line on the
timed run (2026-12-06, AMD EPYC), nothing at BERT-base width's 5-300 ms kernels but a
few per cent of a tiny model's 50 us region, a bias against the kernel in its verdict;
and a call beside a run under 1 ms loses under 1 ms.
"""

from __future__ import annotations

import torch

from dynvm.jit.background import checkpoint, on_worker, run_paced, serving
from dynvm.jit.region_slot import Specialization

SHADOW_SPACING = 24   # calls begun after a colliding sample before the next (the Note)
PACED_FROM_S = 1e-3   # a kernel's side pauses for calls where its hits average this or
#                       more (Note [A shadow sample pauses for calls])


class ShadowPacing:
    """When the process's next shadow sample may run (Note [Shadow samples beside
    calls]); one per process, as the calls in flight are."""

    def __init__(self) -> None:
        self._activity = serving()
        self.next_at = 0          # calls begun before the next sample may be taken
        self.collisions = 0       # samples that met a call (diagnostics, tests)

    def spaced(self) -> bool:
        """Whether a sample due now may be taken (one attribute compare, on the call)."""
        return self._activity.calls >= self.next_at

    def sampled(self, collided: bool) -> None:
        """A sample ended; `collided`: it met a call."""
        if collided:
            self.collisions += 1
            self.next_at = self._activity.calls + SHADOW_SPACING


_PACING = ShadowPacing()


def shadow_pacing() -> ShadowPacing:
    """The process's shadow-sample pacing."""
    return _PACING


def shadow_sample(region_jit, spec: Specialization, regs: list) -> None:
    """A shadow sample (Note [Probation]) of a hit of `region_jit` (the RegionJit that
    queued it): the interpreter's steps and the specialization on copies of the hit's
    registers, back to back, each timed once no call is in flight (Note [Background
    work yields to calls]); whether it met a call paces the next (Note [Shadow samples
    beside calls])."""
    probation = spec.probation
    if probation is None:
        return   # decided meanwhile
    activity = serving()
    calls_before, met = activity.calls, False
    clock = region_jit._clock_fn
    # The specialized side is charged its signature too: a call the interpreter
    # runs alone (no JIT) pays none, and in a region of a few microseconds (a loop
    # body) the signature is what decides (Note [Probation]).
    start = clock()
    region_jit._resolved.get(region_jit._layout_sign(regs))
    signing = clock() - start
    specialization_first = len(probation.ratios) % 2 == 1
    # Note [A shadow sample pauses for calls]; under the synchronous switch the sample
    # is the call's own, and nothing else is in flight to pause for.
    pausing = activity if on_worker() else None
    with torch.inference_mode():   # as a call runs
        checkpoint(gap=True)
        met |= activity.busy()
        interpreted = None if specialization_first \
            else region_jit._interpret(regs.copy(), pausing)
        checkpoint(gap=True)
        met |= activity.busy()
        start = clock()
        try:
            if spec.seconds >= PACED_FROM_S * max(1, spec.calls):   # off a worker: as is
                _, paused = run_paced(spec.fn, regs.copy(), clock=clock)
            else:
                spec.fn(regs.copy())
                paused = 0.0
        except Exception:  # noqa: BLE001 — the hit itself deopts if it must
            return
        seconds = clock() - start - paused
        if specialization_first:
            checkpoint(gap=True)
            met |= activity.busy()
            interpreted = region_jit._interpret(regs.copy(), pausing)
    if on_worker():   # under the synchronous switch the sample is the call's own
        _PACING.sampled(met or activity.busy() or activity.calls != calls_before)
    region_jit.engine.probation_counters.shadow_calls += 1
    if interpreted is None:
        return
    # Each hit also carries its share of the signatures of the region's misses
    # since the install (they buy nothing without this specialization's hits).
    counters = region_jit.counters
    calls = counters.interpreted + counters.specialized - spec.installed_at
    share = max(0, calls - spec.calls) / max(1, spec.calls)
    # ... and its share of resolving new layouts (a shape storm: most calls).
    resolving = region_jit.resolve_seconds / max(1, region_jit.region_calls())
    ratio = probation.add(seconds + (signing + resolving) * (1.0 + share), interpreted)
    if ratio is not None and spec.probation is probation:
        # Acted on by the next hit, on its call's thread: a verdict may detach the
        # region (Note [Detached regions]), which counts the call in progress.
        region_jit._verdicts_due.append((spec, probation, ratio))
